"""``hvd.join()`` on a real 4-rank cluster, both wires of CPU tensors (MPI and gloo): ranks
that run out of data serve the others' allreduces and DistributedOptimizer steps with
neutral values, calls they cannot serve raise on the others (nothing hangs), and join returns
the last rank to join, the same everywhere."""

from __future__ import annotations

from helpers import NP, pulled, run_cell, run_ok


def test_joined_ranks_serve_allreduces_with_neutral_values(shell, capsys, cluster, transport):
    """Rank r makes r allreduces of each kind, then joins: the k-th is served by the k ranks
    that have joined (zeros for Sum and Average, still divided by size(); the identity for
    Product, Min and Max)."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
seen = []
for k in range(r):
    a = hvd.allreduce_async(torch.full((5,), 4.0 * (r + 1)), name="a", op=hvd.Average)
    b = hvd.allreduce_async(torch.full((2, 3), r + 1, dtype=torch.int64), name="b",
                            op=hvd.Sum)
    seen.append((hvd.synchronize(a)[0].item(), hvd.synchronize(b)[0, 0].item(),
                 hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Product).item(),
                 hvd.allreduce(torch.tensor([r + 1]), op=hvd.Min).item(),
                 hvd.allreduce(torch.tensor([-r - 1.0]), op=hvd.Max).item()))
    hvd.barrier()
last = hvd.join()
""")
    n = NP
    for rank, (seen, last) in enumerate(zip(pulled(shell, "seen"), pulled(shell, "last"))):
        assert last == n - 1
        assert len(seen) == rank
        for k, (average, summed, product, least, most) in enumerate(seen):
            active = range(k + 1, n)  # ranks 0..k have joined by the k-th call
            assert average == sum(4.0 * (a + 1) for a in active) / n
            assert summed == sum(a + 1 for a in active)
            assert product == float(__import__("math").prod(a + 1 for a in active))
            assert least == k + 2 and most == -(k + 2.0)


def test_uneven_data_trains_with_distributed_optimizer(shell, capsys, cluster, transport):
    """Rank r has r + 1 batches; each joins when it runs out. Its zero gradients are averaged
    in (divided by size(), as Horovod does), and the ranks still training stay identical."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
w = torch.nn.Parameter(torch.zeros(3))
opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)])
after = []
for step in range(r + 1):
    opt.zero_grad()
    (w * (r + 1)).sum().backward()       # this rank's gradient: r + 1
    opt.step()
    after.append(w[0].item())
last = hvd.join()
""")
    n = NP
    for rank, (after, last) in enumerate(zip(pulled(shell, "after"), pulled(shell, "last"))):
        assert last == n - 1
        expected, w = [], 0.0
        for step in range(rank + 1):
            w -= sum(a + 1 for a in range(step, n)) / n  # ranks < step have joined
            expected.append(w)
        assert after == expected


def test_a_joined_rank_serves_the_newest_optimizer_of_the_announced_step(shell, capsys,
                                                                       cluster):
    """An optimizer made before with the same shapes (the cell that makes it run again, one
    left mid-step) is still alive; the others step the new one, which a joined rank serves,
    whatever order the registry holds them in."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
from ipydist.torch._wire import signature
from ipydist.torch.horovod import join as _join
def made():
    w = torch.nn.Parameter(torch.zeros(3))
    return w, hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)])
old_w, old = made()
old.zero_grad()
old_w.sum().backward()     # left mid-step
w, opt = made()
words = signature.header("optimizer step", **opt._signature())
chosen = [_join._server_for(words) is opt, old.serves_step(words)]
old.synchronize()          # its step, finished on every rank alike
del old, old_w
""")
    assert pulled(shell, "chosen") == [[True, True]] * NP


def test_calls_a_joined_rank_cannot_serve_raise_on_the_others(shell, capsys, cluster,
                                                               transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
errors = []
if r == 0:
    last = hvd.join()
else:
    for bad in (lambda: hvd.allgather(torch.ones(2)), lambda: hvd.broadcast(torch.ones(2), 1),
                lambda: hvd.allreduce(torch.ones(1, 1, 1, 1, 1, 1, 1))):
        try:
            bad()
        except RuntimeError as e:
            errors.append(str(e))
    last = hvd.join()
after = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
""")
    for rank, (errors, last, after) in enumerate(zip(
            pulled(shell, "errors"), pulled(shell, "last"), pulled(shell, "after"))):
        assert last != 0 and after == NP
        if rank == 0:
            assert errors == []
            continue
        assert len(errors) == 3
        assert errors[0].startswith("allgather while rank 0 has joined"), errors[0]
        assert errors[1].startswith("broadcast while rank 0 has joined"), errors[1]
        assert "at most 6 dimensions" in errors[2]


def test_join_needs_the_collective_check(shell, capsys, cluster):
    result, out, err = run_cell(shell, capsys, """%%everyrank
import ipydist.torch as hvd
from ipydist.torch._wire import call_check
call_check.set_enabled(False)
try:
    hvd.join()
finally:
    call_check.set_enabled(True)
""")
    assert result.error_in_exec is not None
    assert "learns what the other ranks call from the collective check, which is off" in (
        out + err)
