"""Mismatched collectives raise on every rank, never crash a rank or hang (issue 12, item 4).

Without the check, an allreduce of different shapes aborts a rank inside gloo, different dtypes
are summed as garbage, and a broadcast from two roots waits forever. Here each mismatch must
end the cell within seconds with the same RuntimeError on every rank, with nobody released
(nothing hung) and the group fit for the next cell.
"""

from __future__ import annotations

import enum
import importlib
import time

import pytest
from helpers import NP, as_merged, run_cell

from ipydist.errors import CellTimeout, RankError
from ipydist.protocol import CHECK_COLLECTIVES_ENV
from ipydist.torch._wire import call_check, signature

LAST = NP - 1
#: A cell that works only if every rank is alive and the group is healthy.
NEXT_CELL = "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())"


@pytest.fixture
def hvd_cluster(cluster, shell, capsys):
    result, _, err = run_cell(shell, capsys, "%everyrank import time, torch, ipydist.torch as hvd")
    assert result.error_in_exec is None, err
    return cluster


def assert_every_rank_raised(shell, capsys, code: str, expected: str) -> str:
    """Run ``code``; it must fail on every rank with ``expected`` in its RuntimeError, in a few
    seconds and without a release; and the next cell's collective must work on every rank."""
    t0 = time.monotonic()
    result, _, err = run_cell(shell, capsys, code)
    elapsed = time.monotonic() - t0
    error = result.error_in_exec
    assert isinstance(error, RankError), (error, err)
    assert error.ranks == list(range(NP)), f"not every rank raised: {error}"
    assert error.ename == "RuntimeError", error
    assert expected in error.evalue, error.evalue
    assert {e.evalue for e in error.failures.values()} == {error.evalue}, "one verdict"
    assert error.released == [] and error.notes == [], "nothing hung, nothing was rebuilt"
    assert elapsed < 5, f"the cell took {elapsed:.1f} s"
    result, out, err = run_cell(shell, capsys, NEXT_CELL)
    assert result.error_in_exec is None, err
    assert f"[all ranks] {float(NP)}" in as_merged(out), out
    return error.evalue


@pytest.mark.parametrize("code, expected", [
    pytest.param(
        f"hvd.allreduce(torch.ones(4 + (hvd.rank() == {LAST})))",
        f"allreduce: tensor shapes differ between ranks: ranks 0-{LAST - 1} have (4,), "
        f"rank {LAST} has (5,). Every rank must call the same collectives",
        id="allreduce-shape"),
    pytest.param(
        "hvd.allreduce(torch.ones(4, dtype=torch.int64 if hvd.rank() == 1 else torch.float32))",
        "allreduce: dtypes differ between ranks: ranks 0 and 2-3 have float32, rank 1 has int64",
        id="allreduce-dtype"),
    pytest.param(
        "hvd.allreduce(torch.ones(4), op=hvd.Sum if hvd.rank() == 0 else hvd.Average)",
        "allreduce: reduce ops differ between ranks: rank 0 has Sum, ranks 1-3 have Average",
        id="allreduce-op"),
    pytest.param(
        "hvd.broadcast(torch.ones(4), root_rank=hvd.rank() % 2)",
        "broadcast: root ranks differ between ranks: ranks 0 and 2 have 0, ranks 1 and 3 have 1",
        id="broadcast-root"),
    pytest.param(
        "hvd.allgather(torch.ones(hvd.rank() + 1, 3 + (hvd.rank() == 2)))",
        "allgather: tensor shapes (after the first dimension) differ between ranks: "
        "ranks 0-1 and 3 have (*, 3), rank 2 has (*, 4)",
        id="allgather-trailing-dims"),
    pytest.param(
        "hvd.allreduce(torch.ones(4)) if hvd.rank() == 0 else hvd.broadcast(torch.ones(4), 0)",
        "ranks called different collectives: rank 0 allreduce, ranks 1-3 broadcast",
        id="different-kinds"),
    pytest.param(
        f"hvd.broadcast_parameters(torch.nn.Linear(3, 3 + (hvd.rank() == {LAST})).state_dict())",
        "broadcast_parameters: sizes (elements per dtype) differ between ranks: "
        f"ranks 0-{LAST - 1} have (12,), rank {LAST} has (16,)",
        id="broadcast_parameters"),
])
def test_a_mismatch_raises_on_every_rank(shell, capsys, hvd_cluster, code, expected):
    assert_every_rank_raised(shell, capsys, f"%everyrank {code}", expected)


@pytest.mark.parametrize("bucket_cap_mb, sizes, last_sizes, zeroed_by", [
    # one bucket: no hooks; the check is sent at zero_grad(), collected in step()
    (25, "(58,)", "(65,)", "opt"),
    # a bucket per parameter: collected when the first bucket leaves, in backward
    (1e-7, "(2, 16, 8, 32)", "(2, 18, 9, 36)", "opt"),
    # the optimizer's zero_grad() not called: the check is made in step()
    (25, "(58,)", "(65,)", "model"),
])
def test_a_rank_with_a_different_model_raises_in_distributed_optimizer(
        shell, capsys, hvd_cluster, bucket_cap_mb, sizes, last_sizes, zeroed_by):
    setup = f"""%%everyrank
def make(width):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   bucket_cap_mb={bucket_cap_mb})
    return model, opt

def train(steps):
    for _ in range(steps):
        {zeroed_by}.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()

model, opt = make(8 + (hvd.rank() == {LAST}))
"""
    result, _, err = run_cell(shell, capsys, setup)
    assert result.error_in_exec is None, err
    assert_every_rank_raised(
        shell, capsys, "%everyrank train(1)",
        f"optimizer step: gradient bucket sizes differ between ranks: ranks 0-{LAST - 1} have "
        f"{sizes}, rank {LAST} has {last_sizes}")
    # the optimizers are usable: the same model everywhere trains on, in step
    result, out, err = run_cell(shell, capsys, """%%everyrank
model, opt = make(8)
train(3)
w = model[0].weight.detach()
print(bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min))))
""")
    assert result.error_in_exec is None, err
    assert "[all ranks] True" in as_merged(out), out


def test_the_recovery_ignores_an_optimizer_kept_alive_by_an_old_traceback(
        shell, capsys, hvd_cluster):
    """After a mismatch, each rank's last traceback holds the optimizer of the model that
    mismatched. A later release replaces that traceback on the released ranks only, so the
    recovery's "same tensors everywhere?" must not count what only a traceback keeps alive."""
    setup = f"""%%everyrank
def make(width):
    model = torch.nn.Linear(width, 2)
    return model, hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters())

def step():
    model.zero_grad()  # not the optimizer's: the mismatch raises inside step()
    model(torch.randn(3, model.in_features)).sum().backward()
    opt.step()

model, opt = make(4 + (hvd.rank() == {LAST}))
step()
"""
    result, _, err = run_cell(shell, capsys, setup)
    assert isinstance(result.error_in_exec, RankError), err
    result, _, err = run_cell(shell, capsys, "%everyrank model, opt = make(4); step()")
    assert result.error_in_exec is None, err
    result, _, err = run_cell(
        shell, capsys, "%%everyrank --timeout 3\nif hvd.rank() != 0:\n    hvd.barrier()\n")
    assert isinstance(result.error_in_exec, CellTimeout), err
    assert "Recovery gave up" not in str(result.error_in_exec), result.error_in_exec
    result, out, err = run_cell(shell, capsys, NEXT_CELL)
    assert result.error_in_exec is None, err
    assert f"[all ranks] {float(NP)}" in as_merged(out), out


def test_a_rank_that_calls_allreduce_instead_of_a_step_raises_with_the_others(
        shell, capsys, hvd_cluster):
    """The others' step was announced at zero_grad(): it meets the allreduce's header there,
    and every rank raises (see the next test for a call between zero_grad() and step())."""
    run_cell(shell, capsys, """%%everyrank
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
""")
    assert_every_rank_raised(shell, capsys, f"""%%everyrank
if hvd.rank() == {LAST}:
    hvd.allreduce(torch.ones(1))
else:
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
""", f"ranks called different collectives: ranks 0-{LAST - 1} optimizer step, rank {LAST} "
     "allreduce")


def test_the_step_checked_at_zero_grad_lets_other_collectives_come_before_it(
        shell, capsys, hvd_cluster):
    """zero_grad() sends the step's check ahead; collectives the ranks all make before step()
    (a metric, a broadcast) meet in order after it, and a step with no zero_grad() before it
    is checked where its first bucket leaves."""
    result, out, err = run_cell(shell, capsys, """%%everyrank
from ipydist.torch._wire import call_check
from ipydist.torch._core import topology
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
sent = []
real = call_check._gather_over_mpi  # what every check on the spot waits in, under mpiexec
call_check._gather_over_mpi = lambda *args: sent.append(1) or real(*args)
try:
    for i in range(3):
        opt.zero_grad()
        announced = topology.get().announced and opt._announced is not None
        model(torch.randn(3, 4) + hvd.rank()).sum().backward()
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
        opt.step()
    model.zero_grad()  # not the optimizer's: nothing is announced, step() checks itself
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
finally:
    call_check._gather_over_mpi = real
w = model.weight.detach()
same = bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min)))
print(announced, total, len(sent), same, len(topology.get().announced))
""")
    assert result.error_in_exec is None, err
    # three allreduces and the last step exchanged headers on the spot; the announced ones not
    assert f"[all ranks] True {float(NP)} 4 True 0" in as_merged(out), out


def test_a_rank_waiting_in_the_check_is_reported_in_the_collective_it_called(
        shell, capsys, hvd_cluster):
    """Stall warnings and release reports name what the user called, not the header exchange
    the rank actually waits in."""
    result, out, err = run_cell(shell, capsys, f"""%%everyrank
import sys, threading
from ipydist.rank.stack_sampler import collective_frame
main, seen = threading.main_thread().ident, []
def look():
    time.sleep(0.5)
    found = collective_frame(sys._current_frames()[main])
    seen.append(found and found[1])
for call in (lambda: hvd.allreduce(torch.ones(2)), hvd.barrier,
             lambda: hvd.broadcast(torch.ones(2), 0)):
    spy = threading.Thread(target=look)
    spy.start()
    if hvd.rank() == {LAST}:
        time.sleep(1.0)
    call()
    spy.join()
print(seen if hvd.rank() != {LAST} else "late")
""")
    assert result.error_in_exec is None, err
    assert "['all_reduce', 'barrier', 'broadcast']" in out, out


def test_with_the_check_off_no_headers_are_exchanged(shell, capsys, hvd_cluster):
    result, out, err = run_cell(shell, capsys, """%%everyrank
from ipydist.torch._wire import call_check
exchanges = []
real = call_check._gather_over_mpi  # what every exchange of headers waits in, under mpiexec
call_check._gather_over_mpi = lambda *args: exchanges.append(1) or real(*args)
def calls():
    hvd.allreduce(torch.ones(2)); hvd.broadcast(torch.ones(2), 0); hvd.barrier()
    hvd.broadcast_object("x"); hvd.allgather_object(1)
    every = hvd.allgather(torch.ones(hvd.rank() + 1))
    return len(every)
try:
    on = calls(), len(exchanges)
    call_check.set_enabled(False)
    off = calls(), len(exchanges) - on[1]
finally:
    call_check.set_enabled(True)
    call_check._gather_over_mpi = real
print(on, off)
""")
    assert result.error_in_exec is None, err
    gathered = NP * (NP + 1) // 2
    # off: allgather still sends its first dimension in a header, unchecked
    assert f"[all ranks] ({gathered}, 6) ({gathered}, 1)" in as_merged(out), out


def test_the_environment_variable_turns_the_check_off(monkeypatch):
    monkeypatch.setenv(CHECK_COLLECTIVES_ENV, "0")
    try:
        assert not importlib.reload(call_check).enabled()  # read when the module loads
    finally:
        monkeypatch.undo()
        importlib.reload(call_check)
    assert call_check.enabled()


# --- the header and the verdict, without a cluster --------------------------------------------

class Op(enum.Enum):
    Average = "average"
    Sum = "sum"


def test_identical_headers_agree_and_the_carried_word_is_not_compared():
    import torch

    a = signature.header("allgather", torch.float32, torch.device("cpu"), (3,), carried=5)
    b = signature.header("allgather", torch.float32, torch.device("cpu"), (3,), carried=7)
    assert len(a) == signature.HEADER_WORDS
    assert signature.disagreement([a, b, a]) is None


def test_the_verdict_names_every_field_that_differs_and_who_had_what():
    import torch

    def h(dtype=torch.float32, shape=(4,), op=Op.Sum, **kw):
        return signature.header("allreduce", dtype, torch.device("cpu"), shape, op, **kw)

    message = signature.disagreement(
        [h(), h(), h(torch.float16, (2, 2), Op.Average), h(prescale=0.5)])
    assert message == (
        "allreduce: dtypes differ between ranks: ranks 0-1 and 3 have float32, rank 2 has float16; "
        "tensor shapes differ between ranks: ranks 0-1 and 3 have (4,), rank 2 has (2, 2); "
        "reduce ops differ between ranks: ranks 0-1 and 3 have Sum, rank 2 has Average; "
        "prescale factors differ between ranks: ranks 0-2 have 1, rank 3 has 0.5. "
        + signature.ADVICE)
    # shapes past MAX_DIMS differ by their CRC
    long = (1,) * signature.MAX_DIMS
    assert "tensor shapes differ" in signature.disagreement([h(shape=(*long, 2)),
                                                             h(shape=(*long, 3))])
    assert signature.disagreement([h(shape=(*long, 2)), h(shape=(*long, 2))]) is None


def test_different_kinds_are_reported_as_such_whatever_else_differs():
    import torch

    a = signature.header("allreduce", torch.float32, torch.device("cpu"), (4,))
    b = signature.header("broadcast", torch.int64, torch.device("cpu"), (9,), root=1)
    assert signature.disagreement([a, b, b]) == (
        "ranks called different collectives: rank 0 allreduce, ranks 1-2 broadcast. "
        + signature.ADVICE)


def test_a_plan_that_differs_only_in_its_hash_is_named_by_letters():
    a = signature.header("optimizer step", shape=(10,), extra=signature.plan_hash([10, "fp16"]))
    b = signature.header("optimizer step", shape=(10,), extra=signature.plan_hash([10, "none"]))
    assert signature.disagreement([a, b, a]) == (
        "optimizer step: gradient bucket plans (dtypes, devices or compression) differ between "
        "ranks: ranks 0 and 2 have plan A, rank 1 has plan B. " + signature.ADVICE)
