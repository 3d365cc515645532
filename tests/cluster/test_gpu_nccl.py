"""NCCL clusters on real GPUs (issue 29): CPU tensors beside NCCL, failures that leave no
half-applied step and no rank killed by NCCL's watchdog, and the collectives on CUDA tensors.

They use every GPU of the host, one rank per GPU and at least 2 ranks: on one GPU two ranks
share it over NCCL (``--backend nccl``), by NCCL 2.30's shared mode where the machine's NCCL
has it, else with each rank posing as a host of its own (``NCCL_HOSTID``: NCCL's socket
transport), so NCCL's own behaviour (abort, watchdog) runs on the one GPU the tests are lent.
Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import _thread
import threading

import pytest
import torch
from helpers import as_merged, run_cell, run_ok

from ipydist.errors import CellTimeout, RankError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: One rank per GPU, at least 2: on one GPU both share it over NCCL (see the module's doc).
RANKS = max(2, torch.cuda.device_count())

MODEL = """%%everyrank
import os, time, torch, torch.distributed as dist, ipydist.torch as hvd
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                            torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                            torch.nn.Linear(2048, 10)).to(hvd.device())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                               named_parameters=model.named_parameters(), bucket_cap_mb=4)

def weights():
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().cpu()

def same_everywhere():
    w = weights().to(hvd.device())
    return bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min)))

def batch(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(32, 512, generator=g).to(hvd.device())

before_step = weights()

def train(steps, raise_on=None, when=None, sleep_on=None):
    global before_step
    for step in range(steps):
        opt.zero_grad()
        if hvd.rank() == raise_on and when == "before backward":
            raise ValueError("fails before backward")
        model(batch(step)).square().mean().backward()
        if hvd.rank() == raise_on and when == "after backward":
            raise ValueError("fails after backward")
        if hvd.rank() == sleep_on:
            time.sleep(60)
        before_step = weights()
        opt.step()
"""


@pytest.fixture
def nccl(shell, magics, capsys):
    """Every GPU of the host, one rank each (at least 2), NCCL, the tests' short failure
    grace."""
    s = magics.session
    if (s is None or not s.running or s.size != RANKS or s.options.gpus != "auto"
            or s.options.backend != "nccl"):
        if s is not None and s.running:
            s.stop(quiet=True)
        run_ok(shell, capsys, f"%dist_start --np {RANKS} --gpus auto --backend nccl")
    magics.session.options = magics.session.options.changed(failure_grace=1.0)
    run_ok(shell, capsys, MODEL)
    return magics.session


def _pids(session) -> list[int]:
    return [r["pid"] for r in session.ranks]


def _same_ranks_train_on(shell, capsys, session, pids) -> None:
    """No rank was killed (by NCCL's watchdog or anything), and the next cell trains, with
    every rank's model identical."""
    assert _pids(session) == pids
    out = run_ok(shell, capsys, """%%everyrank
train(3)
print("same:", same_everywhere(), os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
""")
    assert "[all ranks] same: True 2" in as_merged(out, RANKS), out


def test_the_group_serves_cuda_with_nccl_and_cpu_with_gloo(shell, capsys, nccl):
    out = run_ok(shell, capsys, """%%everyrank
print(dist.get_backend_config())
ok = []
for device in ("cpu", hvd.device()):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                  torch.complex64, torch.uint8):
        t = torch.ones(5, device=device).to(dtype)
        ok.append(bool(hvd.allreduce(t, op=hvd.Sum).to(torch.float64).eq(hvd.size()).all()))
        ok.append(hvd.allgather(t).shape[0] == 5 * hvd.size())
        ok.append(bool(hvd.broadcast(t, root_rank=0).to(torch.float64).eq(1).all()))
c = torch.ones(3)
dist.all_reduce(c)  # a CPU tensor on the default group: its gloo part
ok.append(c.eq(hvd.size()).all().item())
ok.append(hvd.allgather_object(hvd.rank()) == list(range(hvd.size())))
print("all right:", all(ok))
""")
    assert "[all ranks] cpu:gloo,cuda:nccl" in as_merged(out, RANKS), out
    assert "[all ranks] all right: True" in as_merged(out, RANKS), out


@pytest.mark.parametrize("when", ["before backward", "after backward"])
def test_a_rank_that_raises_leaves_no_step_half_applied(shell, capsys, nccl, when):
    pids = _pids(nccl)
    run_ok(shell, capsys, "%everyrank train(2); start = weights()")
    result, _, err = run_cell(shell, capsys, f"%everyrank train(5, raise_on=1, when={when!r})")
    assert isinstance(result.error_in_exec, RankError), err
    out = run_ok(shell, capsys, "%everyrank print('unchanged:', bool(weights().equal(start)), "
                                "bool(weights().isfinite().all()))")
    # the first step of the cell never completed on any rank: nothing of it was applied
    assert "[all ranks] unchanged: True True" in as_merged(out, RANKS), out
    _same_ranks_train_on(shell, capsys, nccl, pids)


def test_the_stop_button_during_step_applies_nothing_of_it(shell, capsys, nccl):
    pids = _pids(nccl)
    timer = threading.Timer(3.0, _thread.interrupt_main)
    timer.start()
    try:
        result, _, err = run_cell(shell, capsys, "%everyrank train(10**6, sleep_on=0)")
    finally:
        timer.cancel()
    assert isinstance(result.error_in_exec, KeyboardInterrupt), err
    out = run_ok(shell, capsys, "%everyrank print('as before the step:', "
                                "bool(weights().equal(before_step)))")
    assert "[all ranks] as before the step: True" in as_merged(out, RANKS), out
    _same_ranks_train_on(shell, capsys, nccl, pids)


def test_a_hung_process_set_collective_is_released(shell, capsys, nccl):
    pids = _pids(nccl)
    run_ok(shell, capsys, "%everyrank pair = hvd.add_process_set([0, 1])")
    result, _, err = run_cell(shell, capsys, """%%everyrank --timeout 5
if hvd.rank() == 0:
    t = hvd.allreduce(torch.ones(4, device=hvd.device()), process_set=pair)
    torch.cuda.synchronize()  # waits on the device for rank 1, which never comes
time.sleep(60)
""")
    assert isinstance(result.error_in_exec, CellTimeout), err
    out = run_ok(shell, capsys, """%%everyrank
s = hvd.allreduce(torch.ones(4, device=hvd.device()), op=hvd.Sum)
p = hvd.allreduce(torch.ones(4, device=hvd.device()), op=hvd.Sum, process_set=pair) \\
    if hvd.rank() in (0, 1) else torch.full((4,), 2.0)
print("sums:", s[0].item() == hvd.size(), p[0].item() == 2.0)
""")
    assert "[all ranks] sums: True True" in as_merged(out, RANKS), out
    _same_ranks_train_on(shell, capsys, nccl, pids)


def test_collectives_on_cuda_tensors(shell, capsys, nccl):
    out = run_ok(shell, capsys, """%%everyrank
n, r, dev = hvd.size(), hvd.rank(), hvd.device()
ok = {}
a = hvd.alltoall(torch.arange(n, device=dev) + 100 * r)
ok["alltoall"] = a.tolist() == [100 * j + r for j in range(n)] and a.is_cuda
rs = hvd.reducescatter(torch.ones(2 * n, device=dev), op=hvd.Sum)
ok["reducescatter"] = rs.tolist() == [float(n)] * 2 and rs.is_cuda
g = hvd.grouped_allreduce([torch.ones(3, device=dev), torch.full((2,), float(r), device=dev)],
                          op=hvd.Sum)
ok["grouped"] = g[0].tolist() == [float(n)] * 3 and g[1].tolist() == [float(sum(range(n)))] * 2
ad = hvd.allreduce(torch.ones(8, device=dev), op=hvd.Adasum)
ok["adasum"] = bool(torch.allclose(ad.cpu(), torch.ones(8)))  # Adasum of equal vectors: them
evens = hvd.add_process_set(list(range(0, n, 2)))
if r % 2 == 0:
    e = hvd.allreduce(torch.ones(2, device=dev), op=hvd.Sum, process_set=evens)
    ok["set"] = e.tolist() == [float(len(range(0, n, 2)))] * 2
hvd.remove_process_set(evens)
w = torch.zeros(4, device=dev)
for step in range(r + 1):  # rank r has r + 1 batches
    w += hvd.allreduce(torch.ones(4, device=dev), op=hvd.Sum)
last = hvd.join()
ok["join"] = last in range(n)
print("bad:", sorted(k for k, v in ok.items() if not v))
""")
    assert "[all ranks] bad: []" in as_merged(out, RANKS), out


def test_checkpoints_with_block_momentum_mid_block_on_cuda(shell, capsys, nccl, tmp_path):
    """Each rank's local model travels to rank 0 alone, on the CPU, and comes back to its own
    GPU: no rank puts anything on another's GPU."""
    path = tmp_path / "bmuf.pt"
    out = run_ok(shell, capsys, f"""%%everyrank
torch.manual_seed(0)
net = torch.nn.Linear(64, 8).to(hvd.device())
hvd.broadcast_parameters(net.state_dict(), root_rank=0)
bmuf = hvd.BlockMomentum(torch.optim.SGD(net.parameters(), lr=0.05), block_steps=3)
for step in range(2):  # mid-block: the local models differ between ranks
    bmuf.zero_grad()
    net(batch(step)[:, :64]).square().mean().backward()
    bmuf.step()
hvd.save_checkpoint({str(path)!r}, bmuf=bmuf)
local = [p.detach().clone() for p in net.parameters()]
with torch.no_grad():
    for p in net.parameters():
        p.zero_()
bmuf.load_state_dict(hvd.load_checkpoint({str(path)!r})["bmuf"])
others = [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())
          if i != torch.cuda.current_device()]
print("back:", all(torch.equal(a, b) for a, b in zip(local, net.parameters())),
      "others' GPUs untouched:", not any(others))
""")
    assert "[all ranks] back: True others' GPUs untouched: True" in as_merged(out, RANKS), out


def test_sync_batch_norm_on_cuda_against_one_batch_norm(shell, capsys, nccl):
    """Forward, gradients and running statistics against torch's BatchNorm on the whole batch,
    with no wait for the device (sync debug mode), under autocast, and memory within 1.5x of
    BatchNorm's for forward and backward."""
    out = run_ok(shell, capsys, """%%everyrank
r, n, dev = hvd.rank(), hvd.size(), hvd.device()
torch.manual_seed(2)
batches = [torch.randn(4 + k, 8, 16, 16, device=dev) * 3 + 1 for k in range(n)]
sync, plain = hvd.SyncBatchNorm(8).to(dev), torch.nn.BatchNorm2d(8).to(dev)
mine = batches[r].clone().requires_grad_()
union = torch.cat(batches).requires_grad_()
start = sum(len(b) for b in batches[:r])
rows = slice(start, start + len(batches[r]))
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    out = sync(mine)
    out.square().sum().backward()
finally:
    torch.cuda.set_sync_debug_mode("default")
expected = plain(union)
expected.square().sum().backward()
errors = dict(
    out=(out - expected[rows]).abs().max().item(),
    grad=(mine.grad - union.grad[rows]).abs().max().item(),
    weight=(hvd.allreduce(sync.weight.grad, op=hvd.Sum) - plain.weight.grad).abs().max().item(),
    running=(sync.running_var - plain.running_var).abs().max().item())
with torch.autocast("cuda", dtype=torch.float16):
    auto_dtype = str(sync(mine.half()).dtype) == str(plain(mine.half()).dtype)

def peak(bn, x):
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    bn(x).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before

big = torch.randn(32, 64, 56, 56, device=dev, requires_grad=True)
ratio = peak(hvd.SyncBatchNorm(64).to(dev), big) / peak(torch.nn.BatchNorm2d(64).to(dev), big)
print("ok:", max(errors.values()) < 1e-3, auto_dtype, ratio <= 1.5, errors, round(ratio, 2))
""")
    assert "[all ranks] ok: True True True" in as_merged(out, RANKS), out


def test_a_heal_copies_cuda_state_from_gpu_to_gpu(no_cluster):
    """Under NCCL a replacement gets rank 0's CUDA storages by NCCL's send, GPU to GPU (the
    heal's line says how much went that way), onto its own device, views still views; a CPU
    tensor beside them takes the host route."""
    import contextlib
    import io
    import os
    import signal

    import ipydist
    from ipydist.errors import RankDied

    said = io.StringIO()
    with ipydist.Session(np=RANKS, gpus="auto", backend="nccl", elastic=True) as s:
        s.run("import torch, ipydist.torch as hvd\n"
              "torch.manual_seed(0)\n"
              "w = hvd.broadcast(torch.randn(3 << 20, device=hvd.device()), root_rank=0)\n"
              "kept = {'head': w[:10]}\n"
              "c = torch.arange(1000.)")
        os.kill(s.ranks[1]["pid"], signal.SIGKILL)
        with contextlib.suppress(RankDied), contextlib.redirect_stderr(said):
            s.run("pass")
        with contextlib.redirect_stderr(said):
            s.healed()
        s.run("seen = (str(w.device), str(hvd.device()), kept['head'].data_ptr() == w.data_ptr(),"
              " w.cpu(), float(c.sum()))")
        seen = s.pull("seen")
    assert "12.0 MB of it from GPU to GPU" in said.getvalue(), said.getvalue()
    assert [x[0] for x in seen] == [x[1] for x in seen], seen
    assert all(x[2] for x in seen) and torch.equal(seen[0][3], seen[1][3])
    assert {x[4] for x in seen} == {499500.0}
