"""Horovod's reducescatter, grouped allgather and grouped reducescatter, and the fused grouped
allreduce, on a real 4-rank cluster and both wires of CPU tensors (MPI and gloo)."""

from __future__ import annotations

import contextlib
import io

import pytest
from helpers import NP, pulled, run_cell, run_ok

import ipydist


def test_reducescatter_shares_rows_as_horovod_does(shell, capsys, cluster, transport):
    """Rows are shared equally, the first ``rows % size`` ranks taking one more; Sum and
    Average (integers truncated), scale factors, async, and the input left unchanged."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
# row i of every rank's tensor is [i, r]: the sum of row i is [n * i, n (n - 1) / 2]
rows = torch.stack([torch.tensor([float(i), float(r)]) for i in range(2 * n + 1)])
before = rows.clone()
summed = hvd.reducescatter(rows, op=hvd.Sum)
averaged = hvd.reducescatter(rows.to(torch.int64) * 2, op=hvd.Average)
scaled = hvd.reducescatter(rows, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
h = hvd.reducescatter_async(rows[:n], name="rs", op=hvd.Max)
maxed = hvd.synchronize(h)
halves = hvd.reducescatter(torch.ones(n, 3, dtype=torch.float16), op=hvd.Sum)
outcome = (summed.tolist(), averaged.tolist(), str(averaged.dtype), scaled.tolist(),
           maxed.tolist(), torch.equal(rows, before), str(halves.dtype), halves.tolist())
""")
    n = NP
    start = 0
    for rank, outcome in enumerate(pulled(shell, "outcome")):
        summed, averaged, dtype, scaled, maxed, unchanged, half_dtype, halves = outcome
        mine = 3 if rank == 0 else 2  # 2n + 1 rows: rank 0 takes one more
        expected = [[n * float(i), n * (n - 1) / 2] for i in range(start, start + mine)]
        assert summed == expected and scaled == expected
        assert averaged == [[2 * i, (n - 1)] for i in range(start, start + mine)]
        assert dtype == "torch.int64"
        assert maxed == [[float(rank), n - 1.0]]
        assert unchanged
        assert half_dtype == "torch.float16" and halves == [[float(n)] * 3]
        start += mine


def test_reducescatter_gradient_is_the_gathered_gradient(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
x = torch.ones(2 * n, 3, requires_grad=True)
share = hvd.reducescatter(x, op=hvd.Average)
(share * (r + 1)).sum().backward()   # rank r's share has gradient r + 1
y = torch.ones(n, requires_grad=True)
hvd.reducescatter(y, op=hvd.Sum, postscale_factor=3.0).sum().backward()
outcome = (x.grad[:, 0].tolist(), y.grad.tolist())
""")
    n = NP
    for grads, summed in pulled(shell, "outcome"):
        # current Horovod: the gathered gradient, times n for Sum, times the scale factors
        assert grads == [float(j + 1) for j in range(n) for _ in range(2)]
        assert summed == [3.0 * n] * n


def test_grouped_allgather_and_reducescatter(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
gathered = hvd.grouped_allgather([torch.full((r + 1,), r), torch.full((1, 2), float(r))])
h = hvd.grouped_allgather_async([torch.tensor([r])], name="g")
gathered_async = hvd.synchronize(h)
shares = hvd.grouped_reducescatter([torch.ones(n), torch.arange(2.0 * n).reshape(n, 2)],
                                   op=hvd.Sum)
h = hvd.grouped_reducescatter_async([torch.ones(n, dtype=torch.int32)], op=hvd.Sum)
shares_async = hvd.synchronize(h)
outcome = ([g.tolist() for g in gathered], gathered_async[0].tolist(),
           [s.tolist() for s in shares], shares_async[0].tolist())
""")
    n = NP
    for rank, (gathered, gathered_async, shares, shares_async) in enumerate(
            pulled(shell, "outcome")):
        assert gathered[0] == [src for src in range(n) for _ in range(src + 1)]
        assert gathered[1] == [[float(src)] * 2 for src in range(n)]
        assert gathered_async == list(range(n))
        assert shares == [[float(n)], [[n * 2.0 * rank, n * (2.0 * rank + 1)]]]
        assert shares_async == [n]


def test_grouped_allreduce_fuses_mixed_dtypes_and_checks_the_group(shell, capsys, cluster,
                                                                  transport):
    """Tensors of several dtypes in one group come back right (each dtype one buffer), and a
    group that differs between ranks raises on every rank, naming what differs."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
big = torch.full((1 << 18,), float(r))  # 1 MB: reduced where it lies, not fused
ins = [torch.full((2,), r, dtype=torch.int32), torch.full((3,), float(r)), big,
       torch.full((2, 2), r, dtype=torch.int64), torch.full((1,), 2.0 * r)]
outs = hvd.grouped_allreduce_(ins, op=hvd.Sum)
fused = [(str(o.dtype), o.tolist()) for o in outs if o is not big]
big_sum = (outs[2] is big, big.unique().tolist())
""")
    total = sum(range(NP))
    for fused, big in zip(pulled(shell, "fused"), pulled(shell, "big_sum")):
        assert fused == [("torch.int32", [total] * 2), ("torch.float32", [float(total)] * 3),
                         ("torch.int64", [[total] * 2] * 2),
                         ("torch.float32", [2.0 * total])]
        assert big == (True, [float(total)])
    result, out, err = run_cell(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
shapes = [(3,), (2,)] if hvd.rank() != 1 else [(3,), (4,)]
hvd.grouped_allreduce([torch.ones(s) for s in shapes])
""")
    assert result.error_in_exec is not None
    text = out + err
    assert "grouped allreduce: the tensors' dtypes, devices or shapes differ" in text, text
    assert "rank 1 has plan B" in text, text
    # the group is fine afterwards
    run_ok(shell, capsys, """%%everyrank
after = hvd.grouped_allreduce([torch.ones(2)], op=hvd.Sum)[0].tolist()
""")
    assert all(a == [float(NP)] * 2 for a in pulled(shell, "after"))


@pytest.mark.parametrize("wire", ["mpi", "gloo"])
def test_gradients_as_horovod_defines_them_on_two_ranks(wire):
    """The same gradients on 2 ranks (Horovod's CI size), each wire: allgather's averaged,
    broadcast's averaged at the root, reducescatter's gathered and times 2 for Sum."""
    with contextlib.redirect_stdout(io.StringIO()), ipydist.Session(np=2) as s:
        s.run(f"""
import torch, ipydist.torch as hvd
from ipydist.torch._core import topology
topology.get().transport = {wire!r}
r = hvd.rank()
x = torch.ones(r + 1, requires_grad=True)
(hvd.allgather(x) * torch.tensor([1.0, 2.0, 3.0]) * (r + 1)).sum().backward()
g_gather = x.grad.tolist()
x = torch.ones(2, requires_grad=True)
(hvd.broadcast(x, root_rank=0) * (r + 1)).sum().backward()
g_bcast = x.grad.tolist()
x = torch.ones(4, requires_grad=True)
hvd.reducescatter(x, op=hvd.Sum).sum().backward()
g_scatter = x.grad.tolist()
out = (g_gather, g_bcast, g_scatter)
""", output="rank0")
        # the gathered rows weighted 1, 2, 3 by rank 0 and 2, 4, 6 by rank 1: averaged
        assert s.pull("out") == [([1.5], [1.5, 1.5], [2.0] * 4),
                                 ([3.0, 4.5], [0.0, 0.0], [2.0] * 4)]
