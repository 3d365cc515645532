"""``--backend mpi``: ipydist's torch.distributed backend over mpi4py, on a real 4-rank cluster.

DDP and FSDP train on it and match one process; torch.distributed's collectives give what gloo
would; the parts it does not serve, and tensors it cannot carry, raise errors that say what to
do; a peer that never joins DDP's allreduce does not hang the notebook, quiet or loaded."""

from __future__ import annotations

import pytest
from helpers import NP, as_merged, run_cell

from ipydist.errors import CellTimeout


@pytest.fixture(scope="module")
def mpi_cluster(shell):
    magics = shell.magics_manager.registry["DistMagics"]
    if magics.session is not None and magics.session.running:
        magics.session.stop(quiet=True)
    shell.run_cell(f"%dist_start --np {NP} --backend mpi").raise_error()
    session = magics.session
    session.options = session.options.changed(failure_grace=1.0)
    yield session
    session.stop(quiet=True)  # the shared ``cluster`` fixture would otherwise reuse it


def ok(shell, capsys, code: str) -> str:
    result, out, err = run_cell(shell, capsys, code)
    assert result.error_in_exec is None, f"{result.error_in_exec!r}\n{out}\n{err}"
    return out


DDP_TRAINS = """%%everyrank
import torch, torch.distributed as dist, ipydist.torch as hvd
from torch.nn.parallel import DistributedDataParallel as DDP
N, r, b = hvd.size(), hvd.rank(), 4
def make(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(600, 700), torch.nn.Tanh(), torch.nn.Linear(700, 1))
model, ref = DDP(make(seed=r)), make(seed=0)  # wrapping copies rank 0's parameters everywhere
opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref))
torch.manual_seed(0)
X, Y = torch.randn(4 * N * b, 600), torch.randn(4 * N * b, 1)
for step in range(4):
    lo = step * N * b
    opt.zero_grad()
    mine = slice(lo + r * b, lo + (r + 1) * b)
    ((model(X[mine]) - Y[mine]) ** 2).mean().backward()
    opt.step()
    ref_opt.zero_grad()
    ((ref(X[lo:lo + N * b]) - Y[lo:lo + N * b]) ** 2).mean().backward()
    ref_opt.step()
maxdiff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
w = model.module[0].weight.detach()
outcome = (dist.get_backend(), maxdiff, bool(hvd.allreduce(w, op=hvd.Max).equal(
    hvd.allreduce(w, op=hvd.Min))))
"""


def test_ddp_on_the_mpi_backend_matches_one_process(shell, capsys, mpi_cluster):
    assert [i["backend"] for i in mpi_cluster.ranks] == ["mpi4py"] * NP
    ok(shell, capsys, DDP_TRAINS)
    for backend, maxdiff, same in shell.run_line_magic("dist_pull", "outcome"):
        assert backend == "mpi4py"
        assert maxdiff < 1e-5, maxdiff
        assert same, "the ranks' parameters differ"


def test_torch_distributed_collectives_on_the_mpi_backend(shell, capsys, mpi_cluster):
    """Each call checked on every rank against what it must give; the cell collects what
    differed, so one failing assertion names every call that went wrong."""
    ok(shell, capsys, """%%everyrank
import torch, torch.distributed as dist
N, r = dist.get_world_size(), dist.get_rank()
wrong = []
def check(name, got, want):
    if not torch.equal(got, want):
        wrong.append(f"{name}: {got.tolist()} != {want.tolist()}")
R = torch.tensor(float(r + 1))
for dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8, torch.float16, torch.bfloat16):
    for op, want in ((dist.ReduceOp.SUM, N * (N + 1) / 2), (dist.ReduceOp.MAX, N),
                     (dist.ReduceOp.MIN, 1), (dist.ReduceOp.PRODUCT, 24)):
        t = torch.full((5,), r + 1, dtype=dtype)
        dist.all_reduce(t, op=op)
        check(f"all_reduce {dtype} {op}", t, torch.full((5,), want, dtype=dtype))
t = torch.full((3,), float(r + 1)); dist.all_reduce(t, op=dist.ReduceOp.AVG)
check("all_reduce AVG", t, torch.full((3,), (N + 1) / 2))
b = torch.tensor([r == 0, True]); dist.all_reduce(b, op=dist.ReduceOp.MAX)
check("all_reduce bool", b, torch.tensor([True, True]))
strided = torch.arange(12.).reshape(3, 4).t() * (r + 1)  # not contiguous
dist.all_reduce(strided)
check("all_reduce strided", strided, torch.arange(12.).reshape(3, 4).t() * N * (N + 1) / 2)
work = dist.all_reduce(torch.ones(4), async_op=True); work.wait()
check("async all_reduce", work.get_future().value()[0], torch.full((4,), float(N)))
t = torch.full((4,), float(r)); dist.broadcast(t, src=2)
check("broadcast", t, torch.full((4,), 2.0))
h = torch.tensor([r], dtype=torch.bfloat16); dist.broadcast(h, src=1)
check("broadcast bf16", h, torch.tensor([1], dtype=torch.bfloat16))
outs = [torch.empty(2) for _ in range(N)]; dist.all_gather(outs, torch.full((2,), float(r)))
check("all_gather", torch.stack(outs), torch.arange(N).float().repeat_interleave(2).view(N, 2))
into = torch.empty(N * 2); dist.all_gather_into_tensor(into, torch.full((2,), float(r)))
check("all_gather_into_tensor", into, torch.arange(N).float().repeat_interleave(2))
got = torch.empty(2); dist.reduce_scatter_tensor(got, torch.arange(N * 2.) * (r + 1))
check("reduce_scatter_tensor", got, torch.arange(2 * r, 2 * r + 2.) * N * (N + 1) / 2)
splits = [k + 1 for k in range(N)]  # rank r sends k+1 rows to rank k
send = torch.full((sum(splits), 2), float(r))
recv = torch.empty((N * (r + 1), 2))
dist.all_to_all_single(recv, send, output_split_sizes=[r + 1] * N, input_split_sizes=splits)
check("all_to_all_single", recv[:, 0], torch.arange(N).float().repeat_interleave(r + 1))
t = torch.full((2,), float(r + 1)); dist.reduce(t, dst=3)
if r == 3:
    check("reduce", t, torch.full((2,), N * (N + 1) / 2))
g = [torch.empty(1) for _ in range(N)] if r == 0 else None
dist.gather(torch.tensor([float(r)]), g, dst=0)
if r == 0:
    check("gather", torch.cat(g), torch.arange(N).float())
s = torch.empty(1)
dist.scatter(s, [torch.tensor([10. + k]) for k in range(N)] if r == 1 else None, src=1)
check("scatter", s, torch.tensor([10. + r]))
if r % 2 == 0:
    dist.send(torch.tensor([float(r)]), dst=r + 1)
else:
    got = torch.empty(1); dist.recv(got, src=r - 1); check("send/recv", got, torch.tensor([r - 1.]))
dist.barrier()
objs = [None] * N; dist.all_gather_object(objs, {"rank": r})
if objs != [{"rank": k} for k in range(N)]:
    wrong.append(f"all_gather_object: {objs}")
box = [f"from {r}"]; dist.broadcast_object_list(box, src=3)
if box != ["from 3"]:
    wrong.append(f"broadcast_object_list: {box}")
from ipydist.torch._core import topology as _rt
_rt.get().split_large = True  # 4 ranks on 2 cores agreed on whole; pieces on every rank now
big = torch.full((3_000_000,), float(r + 1))  # 12 MB: three pieces
dist.all_reduce(big, op=dist.ReduceOp.MAX)
_rt.get().split_large = False
check("all_reduce in pieces", big[::999_999], torch.full((4,), float(N)))
half = dist.new_group([0, 1])  # made on every rank, used by its members
if r < 2:
    t = torch.ones(1); dist.all_reduce(t, group=half)
    check("new_group([0, 1])", t, torch.tensor([2.]))
""")
    wrong = shell.run_line_magic("dist_pull", "wrong")
    assert wrong == [[]] * NP, wrong


def test_what_the_backend_cannot_do_says_what_to_use(shell, capsys, mpi_cluster):
    ok(shell, capsys, """%%everyrank
import torch, torch.distributed as dist
errors = []
for call in (lambda: dist.all_to_all([torch.empty(1)] * 4, [torch.ones(1)] * 4),
             lambda: dist.all_reduce(torch.ones(1, device="meta"))):
    try:
        call()
        errors.append(None)
    except RuntimeError as e:
        errors.append(str(e))
dist.barrier()  # the group still works
""")
    for errors in shell.run_line_magic("dist_pull", "errors"):
        alltoall, meta = errors
        assert alltoall is not None and "does not provide alltoall" in alltoall, alltoall
        assert "gloo" in alltoall and "all_to_all_single is served" in alltoall
        assert meta is not None and "carries CPU tensors, not meta ones" in meta, meta
        assert "--backend nccl" in meta


def test_fsdp_on_the_mpi_backend_matches_one_process(shell, capsys, mpi_cluster):
    ok(shell, capsys, """%%everyrank
import torch, torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
N, r = dist.get_world_size(), dist.get_rank()
def make():
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
sharded, ref = FSDP(make(), device_id=torch.device("cpu")), make()
opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, ref))
torch.manual_seed(0)
X = torch.randn(3 * N * 2, 8)
for step in range(3):
    batch = X[step * N * 2:(step + 1) * N * 2]
    opt.zero_grad(); sharded(batch[r * 2:r * 2 + 2]).square().mean().backward(); opt.step()
    ref_opt.zero_grad(); ref(batch).square().mean().backward(); ref_opt.step()
with FSDP.summon_full_params(sharded):
    fsdp_diff = max((p - q).abs().max().item() for p, q in zip(sharded.parameters(),
                                                                ref.parameters()))
""")
    diffs = shell.run_line_magic("dist_pull", "fsdp_diff")
    assert max(diffs) < 1e-5, diffs


def test_ipydist_collectives_through_the_backend(shell, capsys, mpi_cluster):
    """With --transport gloo, hvd's collectives go through the process group: this one."""
    ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
from ipydist.torch._core import topology as _rt
from ipydist.torch._wire import transport as _tp
_rt.get().transport = "gloo"
try:
    through_group = not _tp.uses_mpi(torch.ones(1))
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    gathered = hvd.allgather(torch.tensor([hvd.rank()] * (hvd.rank() + 1))).tolist()
    root = hvd.broadcast(torch.tensor([hvd.rank()]), root_rank=2).item()
finally:
    _rt.get().transport = "mpi"
results = (through_group, total, gathered, root)
""")
    want_gathered = [k for k in range(NP) for _ in range(k + 1)]
    for through_group, total, gathered, root in shell.run_line_magic("dist_pull", "results"):
        assert through_group
        assert total == NP * (NP - 1) / 2 and gathered == want_gathered and root == 2


@pytest.mark.parametrize("load", ["quiet", "loaded"])
def test_a_peer_that_never_joins_ddp_does_not_hang_the_notebook(shell, capsys, mpi_cluster,
                                                                request, load):
    """A rank sleeps before its backward while the others wait in DDP's allreduce, inside
    C++: the cell's timeout releases them (the group fails their futures), the group is
    rebuilt, and the DDP model trains on, over the new group. Loaded: CPU hogs on every
    core."""
    if load == "loaded":
        request.getfixturevalue("hogs")
    ok(shell, capsys, DDP_TRAINS)
    result, out, err = run_cell(shell, capsys, f"""%%everyrank --timeout 3
import time
while True:
    opt.zero_grad()
    loss = model(X[:4]).square().mean()
    if hvd.rank() == {NP - 1}:
        time.sleep(60)
    loss.backward()
    opt.step()
""")
    error = result.error_in_exec
    assert isinstance(error, CellTimeout), (error, err)
    assert "rebuilt on every rank" in str(error) and "moved onto it: model" in str(error), error
    out = ok(shell, capsys, """%%everyrank
for _ in range(3):
    opt.zero_grad(); model(X[:4]).square().mean().backward(); opt.step()
w = model.module[0].weight.detach()
print("same:", bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min))),
      dist.get_backend())
""")
    assert "[all ranks] same: True mpi4py" in as_merged(out), out


def test_user_code_asking_for_mpi_keeps_the_group(shell, capsys, mpi_cluster):
    """Code written for torch's own MPI backend calls init_process_group("mpi"): the torch
    wheels have none, so ipydist's group, which stands in for it, is kept."""
    ok(shell, capsys, """%%everyrank
import torch.distributed as dist
before = dist.group.WORLD
dist.init_process_group(backend="mpi")
kept = (dist.group.WORLD is before, dist.get_backend())
""")
    assert shell.run_line_magic("dist_pull", "kept") == [(True, "mpi4py")] * NP
