"""Horovod's process sets on a real 4-rank cluster, both wires of CPU tensors (MPI and gloo):
every collective among a subset of the ranks, sets made at init and removed, bad use refused
with a message, a mismatch inside a set raised on its members only, and a set that still
works after a failed cell left one of its operations behind."""

from __future__ import annotations

from helpers import NP, pulled, run_cell, run_ok

EVEN, ODD = list(range(0, NP, 2)), list(range(1, NP, 2))


def test_every_collective_runs_among_a_set(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
even = hvd.add_process_set([q for q in range(hvd.size()) if q % 2 == 0])
odd = hvd.add_process_set(hvd.ProcessSet([q for q in range(hvd.size()) if q % 2]))
mine = even if r % 2 == 0 else odd
ranks = mine.ranks
got = dict(
    id=(even.process_set_id, odd.process_set_id), rank=mine.rank(), size=mine.size(),
    included=(even.included(), odd.included()),
    summed=hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=mine).item(),
    averaged=hvd.allreduce(torch.tensor([r + 1.0]), process_set=mine).item(),
    inplace=hvd.allreduce_(torch.tensor([r]), op=hvd.Max, process_set=mine).item(),
    gathered=hvd.allgather(torch.full((r + 1,), r), process_set=mine).tolist(),
    root=hvd.broadcast(torch.tensor([r]), ranks[-1], process_set=mine).item(),
    shares=hvd.reducescatter(torch.arange(4.0), op=hvd.Sum, process_set=mine).tolist(),
    exchanged=hvd.alltoall(torch.tensor([r, r]), process_set=mine).tolist(),
    grouped=[t.item() for t in hvd.grouped_allreduce(
        [torch.tensor([1.0]), torch.tensor([r])], op=hvd.Sum, process_set=mine)],
    objects=hvd.allgather_object(r, process_set=mine),
    chosen=hvd.broadcast_object(f"from {r}", ranks[0], process_set=mine),
    world=hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item(),
)
h = hvd.allreduce_async(torch.tensor([2.0]), op=hvd.Sum, process_set=mine)
got["async"] = hvd.synchronize(h).item()
hvd.barrier(process_set=mine)
x = torch.tensor([float(r)], requires_grad=True)
hvd.allreduce(x * 1.0, op=hvd.Sum, process_set=mine).sum().backward()
got["grad"] = x.grad.item()
got["global"] = (hvd.global_process_set.size(), hvd.global_process_set.rank(),
                 hvd.global_process_set.included())
got["removed"] = (hvd.remove_process_set(even), hvd.remove_process_set(odd))
""")
    for rank, got in enumerate(pulled(shell, "got")):
        ranks = EVEN if rank % 2 == 0 else ODD
        n = len(ranks)
        assert got["id"][1] == got["id"][0] + 1 and got["removed"] == (True, True)
        assert got["rank"] == ranks.index(rank) and got["size"] == n
        assert got["included"] == (rank % 2 == 0, rank % 2 == 1)
        assert got["summed"] == sum(q + 1 for q in ranks)
        assert got["averaged"] == sum(q + 1 for q in ranks) / n
        assert got["inplace"] == ranks[-1]
        assert got["gathered"] == [q for q in ranks for _ in range(q + 1)]
        assert got["root"] == ranks[-1]
        share = 4 // n
        me = ranks.index(rank)
        assert got["shares"] == [n * float(v) for v in range(me * share, (me + 1) * share)]
        assert got["exchanged"] == ranks
        assert got["grouped"] == [n, sum(ranks)]
        assert got["objects"] == ranks and got["chosen"] == f"from {ranks[0]}"
        assert got["world"] == NP and got["async"] == 2.0 * n
        assert got["grad"] == n  # the gradient of a sum over the set is the set's sum of ones
        assert got["global"] == (NP, rank, True)


def test_sets_at_init_removal_and_bad_use(shell, capsys, cluster):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
low, middle = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
hvd.init(process_sets=[low, middle])
hvd.init(process_sets=[low, middle, [2, 1]])  # again: nothing new
errors = {}
def refused(key, call, kind=ValueError):
    try:
        call()
    except kind as e:
        errors[key] = str(e)
if r not in (0, 1):
    refused("outsider", lambda: hvd.allreduce(torch.ones(1), process_set=low))
refused("duplicate", lambda: hvd.add_process_set([1, 0]))
refused("out of range", lambda: hvd.add_process_set([0, hvd.size()]))
refused("not a set", lambda: hvd.allreduce(torch.ones(1), process_set=[0, 1]), TypeError)
if r in (0, 1):
    refused("root outside", lambda: hvd.broadcast(torch.ones(1), 3, process_set=low))
removed = (hvd.remove_process_set(low), low.process_set_id, hvd.remove_process_set(low))
refused("removed", lambda: hvd.allreduce(torch.ones(1), process_set=low))
hvd.remove_process_set(middle)
""")
    for rank, (errors, removed) in enumerate(zip(pulled(shell, "errors"),
                                                 pulled(shell, "removed"))):
        assert removed == (True, None, False)
        assert "rank" in errors.get("outsider", "rank") and (
            rank in (0, 1) or "is not in ProcessSet" in errors["outsider"])
        assert "exists already" in errors["duplicate"]
        assert "needs ranks among 0..3" in errors["out of range"]
        assert "must be a hvd.ProcessSet" in errors["not a set"]
        assert rank not in (0, 1) or "is not in the process set" in errors["root outside"]
        assert "has not been added" in errors["removed"]


def test_a_mismatch_inside_a_set_raises_on_its_members(shell, capsys, cluster, transport):
    result, out, err = run_cell(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
pair = hvd.add_process_set([0, 1])
if r in (0, 1):
    hvd.allreduce(torch.ones(2 + r), process_set=pair)
""")
    assert result.error_in_exec is not None
    text = out + err
    assert "tensor shapes differ between ranks" in text, text
    run_ok(shell, capsys, """%%everyrank
ok = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=pair).item() if r in (0, 1) else 0
hvd.remove_process_set(pair)
""")
    assert pulled(shell, "ok") == [2.0, 2.0, 0, 0]


def test_a_set_works_after_a_failed_cell_left_its_operation_behind(shell, capsys, cluster,
                                                                  transport):
    """Rank 1 fails while rank 0 waits for it in an allreduce on their set: the recovery
    makes the set's communicators again, and the next cell uses the set as usual."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
pair = hvd.add_process_set([0, 1])
""")
    result, out, err = run_cell(shell, capsys, """%%everyrank
if r == 1:
    raise RuntimeError("rank 1 gives up")
if r == 0:
    hvd.allreduce(torch.ones(1 << 16), process_set=pair)
""")
    assert result.error_in_exec is not None
    assert "rank 1 gives up" in out + err
    run_ok(shell, capsys, """%%everyrank
after = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=pair).item() \\
    if r in (0, 1) else None
world = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
hvd.remove_process_set(pair)
""")
    assert pulled(shell, "after") == [3.0, 3.0, None, None]
    assert pulled(shell, "world") == [float(NP)] * NP


def test_optimizers_on_some_ranks_only_leave_the_recovery_whole(shell, capsys, cluster):
    """A DistributedOptimizer of a process set, and one made on some ranks only, exist on
    some ranks: an interrupted cell's recovery still puts the world's model back in step
    (it once broadcast tensors of different shapes under one name and aborted the ranks)."""
    run_ok(shell, capsys, """%%everyrank
import time, torch, ipydist.torch as hvd
r = hvd.rank()
pair = hvd.add_process_set([0, 1])
w, v = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(5))
if r in (0, 1):
    paired = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                                      process_set=pair)
    lonely = hvd.DistributedOptimizer(torch.optim.SGD([v], lr=1.0), named_parameters=[("v", v)])
m = torch.nn.Linear(3, 3)
hvd.broadcast_parameters(m.state_dict(), 0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                               named_parameters=m.named_parameters())
""")
    result, out, err = run_cell(shell, capsys, """%%everyrank --timeout 2
for step in range(100):
    opt.zero_grad()
    m(torch.ones(1, 3) * (r + 1)).sum().backward()
    opt.step()
    if r == 3 and step == 3:
        time.sleep(60)
""")
    assert result.error_in_exec is not None
    assert "collectives work in the next cell" in out + err, out + err
    run_ok(shell, capsys, """%%everyrank
weights = hvd.allgather(m.weight.detach()[None])
same = bool((weights == weights[0]).all())
hvd.remove_process_set(pair)
""")
    assert pulled(shell, "same") == [True] * NP
