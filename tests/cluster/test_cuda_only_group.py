"""An NCCL cluster's CPU traffic, tested without a GPU (issue 29).

A default group of NCCL alone serves CUDA tensors only, and a collective on a CPU tensor then
fails with "No backend type associated with device type cpu". ipydist moves CPU tensors
itself: the recovery's checksums, pickled objects, the per-call check, dtypes MPI cannot
carry, everything under ``--transport gloo``, 1-bit SGD's messages, checkpoints. CPU torch
makes a group of the same kind: ``cuda:gloo`` serves the ``cuda`` device type only. These tests
make the default group that stand-in and run each of those paths on it, with an interrupted
and a failed cell each followed by one that trains; and the two ways user code made such a
group go wrong (``init_process_group("cpu:gloo,cuda:nccl")`` on CPU ranks, and a default group
with a rendezvous of its own after a failed cell).
"""

from __future__ import annotations

import time

import pytest
from helpers import as_merged, run_cell, run_ok
from test_failures import run_interrupted

from ipydist.errors import RankError

NP2 = 2

STAND_IN = """%%everyrank
import time, torch, torch.distributed as dist, ipydist.torch as hvd
dist.destroy_process_group()
dist.init_process_group("cuda:gloo")  # serves CUDA tensors only, as NCCL alone does
"""

TRAIN = """%%everyrank
def train(model, opt, steps, sleep_on=None):
    for step in range(steps):
        torch.manual_seed(100 * hvd.rank() + step)
        opt.zero_grad()
        model(torch.randn(16, 32)).square().mean().backward()
        if hvd.rank() == sleep_on:
            time.sleep(60)  # the others wait for its gradients
        opt.step()

def same_everywhere(model):
    w = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    return bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min)))
"""


@pytest.fixture
def cuda_only(shell, magics, capsys):
    """A 2-rank ``--transport gloo`` cluster whose default group serves CUDA tensors only."""
    s = magics.session
    if s is None or not s.running or s.size != NP2 or s.options.transport != "gloo":
        if s is not None and s.running:
            s.stop(quiet=True)
        run_ok(shell, capsys, f"%dist_start --np {NP2} --transport gloo")
        magics.session.options = magics.session.options.changed(failure_grace=1.0)
    run_ok(shell, capsys, STAND_IN)
    run_ok(shell, capsys, TRAIN)
    return magics.session


def test_the_stand_in_serves_cuda_tensors_only(shell, capsys, cuda_only):
    out = run_ok(shell, capsys, """%%everyrank
print(dist.get_backend_config())
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as e:
    print("plain all_reduce:", e)
""")
    assert "[all ranks] cuda:gloo" in as_merged(out, NP2), out
    assert "No backend type associated with device type cpu" in out, out


def test_collectives_on_cpu_tensors_of_every_dtype(shell, capsys, cuda_only):
    out = run_ok(shell, capsys, """%%everyrank
r = hvd.rank()
got = {}
for dtype in (torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16,
              torch.complex64, torch.bool, torch.uint8):
    t = torch.full((3,), r + 1).to(dtype)
    got[str(dtype)] = (hvd.allreduce(t, op=hvd.Sum).tolist(),
                       hvd.allgather(t[: r + 1]).shape[0],
                       hvd.broadcast(t, root_rank=1).tolist())
got["alltoall"] = hvd.alltoall(torch.arange(4) + 10 * r).tolist()
got["reducescatter"] = hvd.reducescatter(torch.ones(4), op=hvd.Sum).tolist()
got["object"] = hvd.broadcast_object({"from": r}, root_rank=1)
got["objects"] = hvd.allgather_object(r)
hvd.barrier()
print(sorted(got.items()))
""")
    expected = {
        "torch.float32": ([3.0] * 3, 3, [2.0] * 3),
        "torch.bool": ([True] * 3, 3, [True] * 3),
        "torch.complex64": ([3 + 0j] * 3, 3, [2 + 0j] * 3),
        "alltoall": [0, 1, 10, 11],
        "reducescatter": [2.0, 2.0],
        "object": {"from": 1},
        "objects": [0, 1],
    }
    line = out.split("[rank 0] ")[-1] if "[rank 0]" in out else out
    for key, value in expected.items():
        if key == "alltoall":
            continue  # differs per rank: checked below
        assert f"('{key}', {value!r})" in line, (key, out)
    assert "('alltoall', [0, 1, 10, 11])" in out, out
    assert "('alltoall', [2, 3, 12, 13])" in out, out


def test_checkpoints_and_one_bit_over_the_side_group(shell, capsys, cuda_only, tmp_path):
    path = tmp_path / "ckpt.pt"
    out = run_ok(shell, capsys, f"""%%everyrank
torch.manual_seed(0)
model = torch.nn.Linear(32, 8)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               compression=hvd.Compression.onebit)
train(model, opt, 4)
bmuf_model = torch.nn.Linear(32, 8)
hvd.broadcast_parameters(bmuf_model.state_dict(), root_rank=0)
bmuf = hvd.BlockMomentum(torch.optim.SGD(bmuf_model.parameters(), lr=0.05), block_steps=3)
train(bmuf_model, bmuf, 2)  # mid-block: the local models differ between ranks
hvd.save_checkpoint({str(path)!r}, model=model, optimizer=opt, bmuf=bmuf)
local = [p.detach().clone() for p in bmuf_model.parameters()]
with torch.no_grad():
    for p in bmuf_model.parameters():
        p.zero_()
state = hvd.load_checkpoint({str(path)!r})
model.load_state_dict(state["model"])
opt.load_state_dict(state["optimizer"])
bmuf.load_state_dict(state["bmuf"])
from ipydist.torch.training import checkpoint as _checkpoint
gathered = _checkpoint._rank_states(dict(optimizer=opt, bmuf=bmuf))  # to rank 0 alone
print("gathered:", sorted((k, len(v)) for k, v in gathered.items()))
print("one-bit ranks equal:", same_everywhere(model))
print("local model back:", all(torch.equal(a, b) for a, b in
                               zip(local, bmuf_model.parameters())))
""")
    assert "[rank 0] gathered: [('bmuf', 2), ('optimizer', 2)]" in out, out
    assert "[rank 1] gathered: []" in out, out
    assert "[all ranks] one-bit ranks equal: True" in as_merged(out, NP2), out
    assert "[all ranks] local model back: True" in as_merged(out, NP2), out


def _train_stepped(shell, capsys) -> None:
    run_ok(shell, capsys, """%%everyrank
torch.manual_seed(0)
model = torch.nn.Linear(32, 8)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
train(model, opt, 3)
""")


def _trains_after(shell, capsys) -> None:
    out = run_ok(shell, capsys, """%%everyrank
train(model, opt, 3)
print(dist.get_backend_config(), same_everywhere(model))
""")
    assert "[all ranks] cuda:gloo True" in as_merged(out, NP2), out


def test_an_interrupted_cell_recovers_and_the_next_one_trains(shell, capsys, cuda_only):
    _train_stepped(shell, capsys)
    # an interrupt between one rank's update and the other's: the resync puts it back
    result, _, err = run_interrupted(shell, capsys, """%%everyrank
if hvd.rank() == 1:
    with torch.no_grad():
        model.weight.add_(1.0)
train(model, opt, 100, sleep_on=0)
""")
    assert isinstance(result.error_in_exec, KeyboardInterrupt), err
    assert "rebuilt" in str(result.error_in_exec), result.error_in_exec
    assert "copied to every rank" in str(result.error_in_exec), result.error_in_exec
    _trains_after(shell, capsys)


def test_a_failed_cell_recovers_and_the_next_one_trains(shell, capsys, cuda_only):
    _train_stepped(shell, capsys)
    _rank_1_fails_and_the_ranks_recover(shell, capsys, "train(model, opt, 2)\n")
    _trains_after(shell, capsys)


def _rank_1_fails_and_the_ranks_recover(shell, capsys, before: str = "") -> None:
    """A cell in which rank 1 raises while rank 0 waits for it in a collective."""
    result, _, err = run_cell(shell, capsys, f"""%%everyrank
{before}if hvd.rank() == 1:
    raise ValueError("rank 1 fails")
hvd.allreduce(torch.ones(3))
""")
    assert isinstance(result.error_in_exec, RankError), err
    assert "gave up" not in str(result.error_in_exec), result.error_in_exec


def test_cpu_gloo_cuda_nccl_on_cpu_ranks_makes_a_gloo_group_at_once(shell, capsys, cuda_only):
    """PyTorch's form for mixed work, on ranks without a GPU: gloo (NCCL cannot be made
    there), through ipydist's rendezvous, in about the time of any group (it hung)."""
    t0 = time.monotonic()
    out = run_ok(shell, capsys, """%%everyrank --timeout 20
dist.destroy_process_group()
dist.init_process_group("cpu:gloo,cuda:nccl")
print(dist.get_backend_config(), hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
""")
    assert time.monotonic() - t0 < 15
    assert "[all ranks] cpu:gloo,cuda:gloo 2.0" in as_merged(out, NP2), out


def test_a_default_group_with_its_own_rendezvous_recovers(shell, capsys, cuda_only, tmp_path):
    """User code that makes the default group through a rendezvous of its own: ipydist takes
    it over, and after a failed cell rebuilds it (same backend) through its own."""
    rendezvous = tmp_path / "rendezvous"
    run_ok(shell, capsys, f"""%%everyrank
dist.destroy_process_group()
dist.init_process_group("cuda:gloo", init_method="file://{rendezvous}",
                        rank=hvd.rank(), world_size=hvd.size())
""")
    _train_stepped(shell, capsys)
    _rank_1_fails_and_the_ranks_recover(shell, capsys)
    _trains_after(shell, capsys)
