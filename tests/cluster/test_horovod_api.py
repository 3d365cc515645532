"""Horovod's API beyond the classic recipe, on a real 4-rank cluster and both wires of CPU
tensors (MPI and gloo): build and runtime queries, the deprecated ``average=``, ``Product``,
async handles, grouped allreduce, alltoall, gradients through the collectives, and the types
gloo lacks."""

from __future__ import annotations

from helpers import NP, as_merged, pulled, run_cell, run_ok

from ipydist.errors import RankError


def test_build_and_runtime_queries(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
answers = dict(initialized=hvd.is_initialized(), mpi=hvd.mpi_built(), gloo=hvd.gloo_built(),
               nccl=hvd.nccl_built(), ccl=hvd.ccl_built(), mpi_on=hvd.mpi_enabled(),
               homogeneous=hvd.is_homogeneous(), threads=hvd.mpi_threads_supported())
""")
    for answers in pulled(shell, "answers"):
        assert answers["initialized"] and answers["mpi"] and answers["gloo"]
        assert answers["nccl"] == 0 and answers["ccl"] is False  # the CPU wheel has no NCCL
        assert answers["mpi_on"] is (transport == "mpi")
        assert answers["homogeneous"] is True
        assert isinstance(answers["threads"], bool)


def test_shutdown_then_init_again(shell, capsys, cluster):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
hvd.shutdown()
states = [hvd.is_initialized()]
hvd.init()
states.append(hvd.is_initialized())
states.append(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
""")
    for states in pulled(shell, "states"):
        assert states == [False, True, float(NP)]


def test_average_argument_product_and_integer_scaling(shell, capsys, cluster, transport):
    """``average=`` (deprecated, with Horovod's warning) picks Average or Sum; Product
    multiplies; integer tensors are scaled in float64 and truncated, as Horovod does."""
    run_ok(shell, capsys, """%%everyrank
import warnings, torch, ipydist.torch as hvd
r = hvd.rank()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    summed = hvd.allreduce(torch.tensor([r + 1.0]), average=False).item()
    averaged = hvd.allreduce(torch.tensor([r + 1.0]), average=True).item()
deprecated = sum("average= is deprecated" in str(w.message) for w in caught)
product = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Product).item()
scaled = hvd.allreduce(torch.tensor([3], dtype=torch.int32), op=hvd.Sum,
                       prescale_factor=0.5).tolist()
try:
    hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    both = None
except ValueError as e:
    both = str(e)
outcome = (summed, averaged, deprecated, product, scaled, both)
""")
    n = NP
    for summed, averaged, deprecated, product, scaled, both in pulled(shell, "outcome"):
        assert summed == n * (n + 1) / 2 and averaged == (n + 1) / 2
        assert deprecated == 2
        assert product == float(__import__("math").factorial(n))
        assert scaled == [n * 1]  # int(3 * 0.5) = 1 on every rank
        assert "not both" in both


def test_async_handles_poll_and_synchronize(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
t = torch.full((100000,), float(r))
h1 = hvd.allreduce_async(t, op=hvd.Sum)
h2 = hvd.allreduce_async_(t.clone(), op=hvd.Max, name="max")
h3 = hvd.allgather_async(torch.full((r + 1, 2), float(r)))
h4 = hvd.broadcast_async(t, root_rank=n - 1)
b = t.clone()
h5 = hvd.broadcast_async_(b, root_rank=0)
h6 = hvd.alltoall_async(torch.arange(n, dtype=torch.float32) + 10 * r)
polls = [hvd.poll(h) for h in (h1, h2, h3, h4, h5, h6)]
s, m, g, c, b2, a = (hvd.synchronize(h) for h in (h1, h2, h3, h4, h5, h6))
try:
    hvd.synchronize(h1)
    again = None
except ValueError as e:
    again = str(e)
outcome = (all(isinstance(p, bool) for p in polls), s[0].item(), m[0].item(), g.shape[0],
           g[-1, 0].item(), c[0].item(), b2 is b, b[0].item(), t[0].item(), a.tolist(), again)
""")
    n = NP
    for rank, outcome in enumerate(pulled(shell, "outcome")):
        bools, s, m, rows, last, c, same, b, t, a, again = outcome
        assert bools
        assert s == sum(range(n)) and m == n - 1
        assert rows == n * (n + 1) // 2 and last == n - 1
        assert c == n - 1 and same and b == 0.0
        assert t == rank, "the async allreduce of a copy leaves the input alone"
        assert a == [float(rank + 10 * j) for j in range(n)]
        assert "no operation in flight has handle" in again


def test_a_name_in_flight_is_refused_on_every_rank(shell, capsys, cluster):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
h = hvd.allreduce_async(torch.ones(10), name="grads")
try:
    hvd.allreduce_async(torch.ones(10), name="grads")
    refused = None
except ValueError as e:
    refused = str(e)
other_kind = hvd.allgather_async(torch.ones(1), name="grads")  # names are per kind
hvd.synchronize(h), hvd.synchronize(other_kind)
h = hvd.allreduce_async(torch.ones(10), name="grads")  # free again once synchronized
hvd.synchronize(h)
""")
    for refused in pulled(shell, "refused"):
        assert "named 'allreduce.grads' is still in flight" in refused


def test_handles_in_flight_when_a_cell_fails_are_abandoned(shell, capsys, cluster):
    result, _, _ = run_cell(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
h = hvd.allreduce_async(torch.ones(1000), name="lost")
raise ValueError("the cell fails with the operation in flight")
""")
    assert isinstance(result.error_in_exec, RankError)
    out = run_ok(shell, capsys, """%%everyrank
try:
    hvd.synchronize(h)
    print("waited")
except RuntimeError as e:
    print("abandoned:", "abandoned when a cell failed" in str(e))
h = hvd.allreduce_async(torch.ones(1000), name="lost")  # the name is free again
print("sum:", hvd.synchronize(h)[0].item())
""")
    assert "[all ranks] abandoned: True" in as_merged(out), out
    assert "[all ranks] sum: 1.0" in as_merged(out), out  # Average of ones


def test_grouped_allreduce(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
ins = [torch.full((3,), float(r)), torch.full((2, 2), 2.0 * r)]
outs = hvd.grouped_allreduce(ins, op=hvd.Sum)
inplace = [t.clone() for t in ins]
back = hvd.grouped_allreduce_(inplace, op=hvd.Average)
h = hvd.grouped_allreduce_async(ins, op=hvd.Max)
maxes = hvd.synchronize(h)
outcome = ([o.sum().item() for o in outs], [o.sum().item() for o in inplace],
           all(a is b for a, b in zip(back, inplace)), [m.max().item() for m in maxes],
           ins[0][0].item())
""")
    n, total = NP, sum(range(NP))
    for rank, (sums, averages, same, maxes, unchanged) in enumerate(pulled(shell, "outcome")):
        assert sums == [3.0 * total, 8.0 * total]
        assert averages == [3.0 * total / n, 8.0 * total / n] and same
        assert maxes == [n - 1.0, 2.0 * (n - 1)] and unchanged == rank


def test_alltoall_with_and_without_splits(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
# rank r sends j + 1 rows to rank j, each row [r, j]
rows = torch.cat([torch.tensor([[r, j]] * (j + 1)) for j in range(n)]).to(torch.int16)
got, received = hvd.alltoall(rows, splits=torch.arange(1, n + 1, dtype=torch.int32))
equal = hvd.alltoall(torch.arange(2 * n, dtype=torch.float64).reshape(n, 2) + 100 * r)
errors = []
for bad in (lambda: hvd.alltoall(torch.ones(n + 1)),
            lambda: hvd.alltoall(torch.ones(n), torch.ones(n)),
            lambda: hvd.alltoall(torch.ones(n - 1), torch.ones(n, dtype=torch.int32))):
    try:
        bad()
    except ValueError as e:
        errors.append(str(e))
outcome = (got.dtype, got.tolist(), received.tolist(), equal.tolist(), errors)
""")
    n = NP
    for rank, (dtype, got, received, equal, errors) in enumerate(pulled(shell, "outcome")):
        assert str(dtype) == "torch.int16"
        assert got == [[src, rank] for src in range(n) for _ in range(rank + 1)]
        assert received == [rank + 1] * n
        assert equal == [[2.0 * rank + 100 * src, 2.0 * rank + 1 + 100 * src]
                         for src in range(n)]
        assert len(errors) == 3
        assert "do not divide among" in errors[0]
        assert "splits must be integers" in errors[1]
        assert "but the tensor has" in errors[2]


def test_gradients_flow_through_the_collectives(shell, capsys, cluster, transport):
    """Current Horovod's gradients: allreduce's is the same allreduce; allgather's is this
    rank's rows of the averaged gradient; broadcast's is the averaged gradient at the root,
    zero elsewhere; alltoall's goes back the way the rows came."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
x = torch.ones(3, requires_grad=True)
hvd.allreduce(x, op=hvd.Sum).sum().backward()
g_sum = x.grad.tolist()
x = torch.ones(3, requires_grad=True)
hvd.allreduce(x, op=hvd.Average).sum().backward()
g_avg = x.grad.tolist()
x = torch.ones(r + 1, 2, requires_grad=True)
gathered = hvd.allgather(x)
(gathered * torch.arange(gathered.shape[0]).unsqueeze(1)).sum().backward()
g_gather = x.grad[:, 0].tolist()
x = torch.ones(2, requires_grad=True)
(hvd.broadcast(x, root_rank=1) * (r + 1)).sum().backward()
g_bcast = x.grad.tolist()
x = torch.arange(float(n), requires_grad=True)
out = hvd.alltoall(x)
(out * (r + 1)).sum().backward()
g_a2a = x.grad.tolist()
outcome = (g_sum, g_avg, g_gather, g_bcast, g_a2a)
""")
    n = NP
    for rank, (g_sum, g_avg, g_gather, g_bcast, g_a2a) in enumerate(pulled(shell, "outcome")):
        assert g_sum == [float(n)] * 3 and g_avg == [1.0] * 3
        offset = rank * (rank + 1) // 2  # rows of the ranks before
        assert g_gather == [float(offset + i) for i in range(rank + 1)]  # the same on all
        mean = sum(range(1, n + 1)) / n  # rank r's gradient was r + 1
        assert g_bcast == ([mean] * 2 if rank == 1 else [0.0, 0.0])
        assert g_a2a == [float(j + 1) for j in range(n)]  # rank j weighted its row by j + 1


def test_types_gloo_lacks_travel_wider_and_come_back(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
s = hvd.allreduce(torch.tensor([r], dtype=torch.int16), op=hvd.Sum)
flags = hvd.broadcast(torch.tensor([r == 0, True]), root_rank=0)
shorts = hvd.allgather(torch.tensor([r], dtype=torch.int16))
outcome = (s.dtype, s.item(), flags.dtype, flags.tolist(), shorts.dtype, shorts.tolist())
""")
    for outcome in pulled(shell, "outcome"):
        assert [str(x) for x in outcome[::2]] == ["torch.int16", "torch.bool", "torch.int16"]
        assert outcome[1] == sum(range(NP)) and outcome[3] == [True, True]
        assert outcome[5] == list(range(NP))
