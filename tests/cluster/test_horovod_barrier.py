"""A barrier lets operations in flight pass, as Horovod's name matching does: a rank may start
an ``*_async`` operation and wait in ``hvd.barrier()`` while another starts it only after the
barrier (Horovod's own ``*_duplicate_name_error`` tests do this). On a real 4-rank cluster and
a 2-rank one (Horovod's CI size), with the call check exchanged over MPI (mpiexec's ranks) and
over the process group (where no MPI communicator serves it)."""

from __future__ import annotations

import contextlib
import io

import pytest
from helpers import NP, TRIALS, as_merged, pulled, run_cell, run_ok

import ipydist
from ipydist.errors import RankError

#: Rank 0 starts each kind of operation and waits in a barrier; the others start theirs after
#: it. A second operation of a name in flight is refused on every rank, then all synchronize.
ACROSS_A_BARRIER = """
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
def start():
    handles = [hvd.allreduce_async(torch.full((17,), r + 1.0), name="same", op=hvd.Sum),
               hvd.allgather_async(torch.full((r + 1,), float(r)), name="same"),
               hvd.broadcast_async(torch.full((3,), float(r)), root_rank=n - 1, name="same"),
               hvd.reducescatter_async(torch.ones(2 * n), name="same", op=hvd.Sum)]
    refused = 0
    for again in (lambda: hvd.allreduce_async(torch.ones(17), name="same"),
                  lambda: hvd.broadcast_async(torch.ones(3), root_rank=0, name="same")):
        try:
            again()
        except ValueError as e:
            refused += "is still in flight" in str(e)
    return handles, refused
if r == 0:
    handles, refused = start()
hvd.barrier()
if r > 0:
    handles, refused = start()
hvd.barrier()
total, gathered, broadcast, scattered = (hvd.synchronize(h) for h in handles)
outcome = (refused, total.tolist(), gathered.tolist(), broadcast.tolist(), scattered.tolist())
"""


def expected(n: int) -> tuple:
    gathered = [float(r) for r in range(n) for _ in range(r + 1)]
    return (2, [n * (n + 1) / 2] * 17, gathered, [float(n - 1)] * 3, [float(n)] * 2)


@pytest.fixture(params=["mpi", "process group"])
def check_wire(request, shell, capsys, cluster):
    """The call check exchanged over MPI (the default under mpiexec), or over the process
    group (as where no MPI communicator serves it), switched on every rank and back."""
    run_ok(shell, capsys, "%everyrank from ipydist.torch._core import topology as _rt; "
                          "_saved_check_comm = _rt.get().check_comm")
    if request.param == "process group":
        run_ok(shell, capsys, "%everyrank _rt.get().check_comm = None")
    yield request.param
    run_ok(shell, capsys, "%everyrank _rt.get().check_comm = _saved_check_comm")


def test_operations_started_across_a_barrier_meet(shell, capsys, cluster, transport,
                                                  check_wire):
    run_ok(shell, capsys, "%%everyrank\n" + ACROSS_A_BARRIER)
    for outcome in pulled(shell, "outcome"):
        assert tuple(outcome) == expected(NP)
    # the cluster goes on: every rank in step
    out = run_ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum)"
                                ".item())")
    assert f"[all ranks] {float(NP)}" in as_merged(out), out


def test_an_operation_put_off_starts_before_the_next_collective(shell, capsys, cluster,
                                                                check_wire):
    """Rank 0's operations were put off by the others' barrier; rank 0 next calls a blocking
    allreduce, the others start the same operations first: they come first on rank 0 too, in
    the order they were started."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
if r == 0:
    first = hvd.allreduce_async(torch.tensor([1.0 + r]), name="first", op=hvd.Sum)
    second = hvd.allgather_async(torch.tensor([10.0 + r]), name="second")
hvd.barrier()
if r > 0:
    first = hvd.allreduce_async(torch.tensor([1.0 + r]), name="first", op=hvd.Sum)
    second = hvd.allgather_async(torch.tensor([10.0 + r]), name="second")
blocking = hvd.allreduce(torch.tensor([100.0]), op=hvd.Sum).item()
outcome = (hvd.synchronize(first).item(), hvd.synchronize(second).tolist(), blocking)
""")
    for outcome in pulled(shell, "outcome"):
        assert outcome == (NP * (NP + 1) / 2, [10.0 + r for r in range(NP)], 100.0 * NP)


def test_waiting_for_an_operation_others_are_past_raises_on_every_rank(shell, capsys,
                                                                      cluster, check_wire):
    """Rank 0 synchronizes an operation the others' barrier put off while they still wait in
    it: in Horovod both would wait forever; here every rank raises, and the cluster goes on."""
    result, out, err = run_cell(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
if hvd.rank() == 0:
    h = hvd.allreduce_async(torch.ones(4), name="never")
    hvd.synchronize(h)
else:
    hvd.barrier()
""")
    assert isinstance(result.error_in_exec, RankError), (out, err)
    text = str(result.error_in_exec)
    assert f"ranks 0-{NP - 1} raised" in text, text
    assert f"rank 0 allreduce, ranks 1-{NP - 1} barrier" in text, text
    out = run_ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum)"
                                ".item())")
    assert f"[all ranks] {float(NP)}" in as_merged(out), out


@pytest.mark.parametrize("wire", ["mpi", "process group"])
def test_operations_started_across_a_barrier_meet_on_two_ranks(wire):
    with contextlib.redirect_stdout(io.StringIO()), ipydist.Session(np=2) as s:
        if wire == "process group":
            s.run("from ipydist.torch._core import topology\n"
                  "import ipydist.torch as hvd\nhvd.init()\n"
                  "topology.get().check_comm = None")
        s.run(ACROSS_A_BARRIER, output="rank0")
        assert [tuple(o) for o in s.pull("outcome")] == [expected(2)] * 2


def test_operations_across_a_barrier_meet_under_load(shell, capsys, cluster, hogs):
    """The same on a loaded machine (busy loops on every core), where the ranks reach the
    barrier and the starts in other orders."""
    for _ in range(TRIALS):
        run_ok(shell, capsys, "%%everyrank\n" + ACROSS_A_BARRIER)
        for outcome in pulled(shell, "outcome"):
            assert tuple(outcome) == expected(NP)
