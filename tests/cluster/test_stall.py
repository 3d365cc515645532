"""Stall warnings (issue 5, item 2): ranks waiting in a collective that others never called.

The logic is tested on real stack frames (a thread blocked in a function whose file lies under
``torch/distributed/``); the behaviour on a real 4-rank cluster with the threshold set low.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
from helpers import NP, as_merged, assert_collectives_work, one_line, run_cell

from ipydist.errors import CellTimeout, RankError
from ipydist.notebook.failures.stall import StallWatch
from ipydist.rank.stack_sampler import CollectiveSampler, collective_frame

THRESHOLD = 2.0  # the tests' stall threshold (the default is 30 s)

_FAKE_TORCH = compile(
    "def all_reduce(gate):\n    gate.wait()\n",
    "/site-packages/torch/distributed/distributed_c10d.py", "exec",
)


class BlockedThread:
    """A thread blocked inside a function named like torch's all_reduce, for real frames."""

    def __init__(self):
        namespace: dict = {}
        exec(_FAKE_TORCH, namespace)
        self.gate = threading.Event()
        self.thread = threading.Thread(target=namespace["all_reduce"], args=(self.gate,))
        self.thread.start()
        time.sleep(0.05)

    def frame(self):
        return sys._current_frames()[self.thread.ident]

    def finish(self):
        self.gate.set()
        self.thread.join()


def test_the_sampler_reports_one_long_call_once_and_when_it_returns():
    blocked = BlockedThread()
    try:
        assert collective_frame(blocked.frame())[1] == "all_reduce"
        sampler = CollectiveSampler(report_after=1.0)
        assert sampler.sample(blocked.frame(), now=0.0) is None  # just seen
        assert sampler.sample(blocked.frame(), now=0.5) is None  # not long yet
        report = sampler.sample(blocked.frame(), now=1.5)
        assert report == {"collective": "all_reduce", "waited": 1.5}
        assert sampler.sample(blocked.frame(), now=2.5) is None  # said once
    finally:
        blocked.finish()
    assert sampler.sample(sys._getframe(), now=3.0) == {"collective": None}
    assert sampler.sample(sys._getframe(), now=4.0) is None


def test_the_sampler_does_not_mistake_many_short_calls_for_one_long_one():
    sampler = CollectiveSampler(report_after=1.0)
    for second in range(5):  # a training loop: every sample finds a different all_reduce call
        blocked = BlockedThread()
        try:
            assert sampler.sample(blocked.frame(), now=float(second)) is None
        finally:
            blocked.finish()


def waiting_in(watch: StallWatch, name: str, ranks, waited: float, now: float) -> None:
    for rank in ranks:
        watch.accept(rank, {"collective": name, "waited": waited}, now)


def test_a_stall_names_the_missing_rank_and_what_it_does_once_past_the_threshold():
    watch = StallWatch([0, 1, 2, 3], threshold=30.0)
    waiting_in(watch, "all_reduce", [0, 1, 2], waited=1.0, now=100.0)
    doing = {3: "running"}
    assert watch.check(120.0, doing) is None  # 21 s: not yet
    warning = watch.check(130.0, doing)
    assert warning.startswith("ipydist stall warning: ranks 0-2 have waited 31 s in all_reduce, "
                              "while rank 3 is still running other code."), warning
    assert watch.check(140.0, doing) is None  # said once
    watch.accept(0, {"collective": None}, 141.0)
    watch.accept(3, {"collective": None}, 141.0)
    assert watch.check(150.0, {0: "finished", 3: "running"}).startswith(
        "ipydist stall warning: ranks 1-2 have waited 51 s in all_reduce, while rank 0 finished "
        "the cell without calling it, and rank 3 is still running other code.")


def test_different_collectives_are_a_stall_and_the_same_one_everywhere_is_not():
    watch = StallWatch([0, 1], threshold=5.0)
    waiting_in(watch, "all_reduce", [0, 1], waited=10.0, now=0.0)
    assert watch.check(1.0, {}) is None  # every rank in the same call: slow, not stalled
    watch.accept(0, {"collective": "broadcast", "waited": 10.0}, 0.0)
    assert watch.check(1.0, {}) is None  # just changed: the others' reports may be stale
    assert "different collectives (rank 0 in broadcast; rank 1 in all_reduce)" in watch.check(
        2.0, {})


def test_peers_of_a_late_rank_that_just_finished_their_collective_are_not_a_stall():
    """Rank 3 was late; once it called the collective every rank finished it, and rank 0
    replied first, while ranks 1-2's last reports still said they waited: no second warning
    then, and none once their replies came."""
    watch = StallWatch([0, 1, 2, 3], threshold=2.0)
    waiting_in(watch, "all_reduce", [0, 1, 2], waited=1.0, now=100.0)
    assert watch.check(102.0, {3: "running"}).startswith(
        "ipydist stall warning: ranks 0-2 have waited 3 s in all_reduce, while rank 3")
    watch.accept(0, {"collective": None}, 107.0)
    doing = {0: "finished", 1: "running", 2: "running", 3: "running"}
    assert watch.check(107.1, doing) is None
    assert watch.check(107.3, {0: "finished", 1: "finished", 2: "finished", 3: "running"}) is None
    assert not watch.waiting


def test_a_threshold_of_zero_turns_the_warning_off():
    watch = StallWatch([0, 1], threshold=0)
    waiting_in(watch, "all_reduce", [0], waited=1000.0, now=0.0)
    assert watch.check(1.0, {1: "running"}) is None


# --- on a real cluster ------------------------------------------------------------------------


@pytest.fixture
def stall_cluster(cluster, shell, capsys):
    saved = cluster.options
    cluster.options = saved.changed(stall_warning=THRESHOLD)
    run_cell(shell, capsys, "%everyrank import sys, time, torch, ipydist.torch as hvd")
    yield cluster
    cluster.options = saved


def test_ranks_waiting_for_a_late_rank_get_a_warning_while_the_cell_runs(shell, capsys,
                                                                         stall_cluster):
    late = NP - 1
    result, out, err = run_cell(shell, capsys, f"""%%everyrank
if hvd.rank() == {late}:
    time.sleep(7)
    print("late rank woke", file=sys.stderr)
print(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())
""")
    assert result.error_in_exec is None, err
    assert f"[all ranks] {float(NP)}" in as_merged(out), out  # the collective completed afterwards
    assert (f"ipydist stall warning: ranks 0-{late - 1} have waited" in one_line(err)
            and f"s in all_reduce, while rank {late} is still running other code."
            in one_line(err)), err
    assert err.index("stall warning") < err.index("late rank woke"), err  # during the cell
    assert err.count("stall warning") == 1, err


def test_a_rank_that_skipped_the_collective_is_named_and_the_timeout_ends_the_cell(
        shell, capsys, stall_cluster):
    result, out, err = run_cell(shell, capsys, """%%everyrank --timeout 6
if hvd.rank() != 0:
    hvd.barrier()
""")
    assert isinstance(result.error_in_exec, CellTimeout), err
    assert (f"ranks 1-{NP - 1} have waited" in one_line(err)
            and "s in barrier, while rank 0 finished the cell without calling it."
            in one_line(err)), err
    result, out, err = run_cell(
        shell, capsys, "%everyrank print(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())")
    assert result.error_in_exec is None, err
    assert f"[all ranks] {float(NP)}" in as_merged(out), out


def test_a_collective_between_zero_grad_and_step_on_one_rank_is_a_named_stall(
        shell, capsys, stall_cluster):
    """What the check sent ahead at zero_grad() cannot catch (see ipydist.torch.training.optimizer):
    the extra call and the others' gradients wait for each other. No rank crashes, the warning
    names both calls, the timeout ends the cell, and the optimizer trains on afterwards."""
    last = NP - 1
    # made beforehand: a process's first torch optimizer imports torch._dynamo (seconds)
    result, out, err = run_cell(shell, capsys, """%%everyrank
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
""")
    assert result.error_in_exec is None, err
    result, out, err = run_cell(shell, capsys, f"""%%everyrank --timeout 6
opt.zero_grad()
model(torch.randn(3, 4)).sum().backward()
if hvd.rank() == {last}:
    hvd.allreduce(torch.ones(1))
opt.step()
""")
    assert isinstance(result.error_in_exec, CellTimeout), err
    assert (f"different collectives (ranks 0-{last - 1} in allreduce of gradients "
            f"(DistributedOptimizer); rank {last} in all_reduce)") in one_line(err), (
        err, result.error_in_exec)
    result, out, err = run_cell(shell, capsys, """%%everyrank
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
w = model.weight.detach()
print(bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min))))
""")
    assert result.error_in_exec is None, err
    assert "[all ranks] True" in as_merged(out), out


def test_a_busy_training_loop_raises_no_warning(shell, capsys, stall_cluster):
    shell.user_ns["THRESHOLD"] = THRESHOLD
    run_cell(shell, capsys, "%dist_push THRESHOLD")
    result, out, err = run_cell(shell, capsys, """%%everyrank
t0, steps = time.monotonic(), 0
while True:  # the ranks agree on when to stop, so every rank runs the same collectives
    late = float(time.monotonic() - t0 > 2 * THRESHOLD)
    if hvd.allreduce(torch.tensor([late]), op=hvd.Sum).item() > 0:
        break
    hvd.allreduce(torch.ones(1000))
    steps += 1
print("done", steps > 100)
""")
    assert result.error_in_exec is None, err
    assert "[all ranks] done True" in as_merged(out), out
    assert "stall" not in err, err


def test_ranks_whose_gradient_hook_waits_on_another_thread_are_released_at_once(
        shell, capsys, cluster):
    """On a GPU a parameter's hook runs on autograd's thread for the device while the main
    thread waits in backward() (issue 29); here backward runs on a thread of the cell's, and
    its first hook waits in the step's check for a rank that failed. The waiting ranks are
    seen there, so they are released at once (not after the 10 s grace), by the first
    release, which breaks the group rather than interrupting Python code; the error reaches
    backward()'s caller."""
    assert cluster.options.failure_grace >= 10
    run_cell(shell, capsys, "%everyrank import threading, torch, ipydist.torch as hvd")
    t0 = time.monotonic()
    result, _, err = run_cell(shell, capsys, f"""%%everyrank
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               bucket_cap_mb=1e-6)  # a bucket per parameter: hooks
if hvd.rank() == {NP - 1}:
    raise ValueError("bad batch on the last rank")
opt.zero_grad()
raised = []
def backward():
    try:
        model(torch.ones(2, 4)).sum().backward()
    except RuntimeError as e:
        raised.append(e)
thread = threading.Thread(target=backward)
thread.start()
thread.join()
raise raised[0] if raised else AssertionError("backward() was not released")
""")
    elapsed = time.monotonic() - t0
    error = result.error_in_exec
    assert isinstance(error, RankError), err
    assert elapsed < 6, f"the cell took {elapsed:.1f} s: released after the grace?"
    message = str(error)
    assert message.startswith(f"rank {NP - 1} raised in the cell: ValueError"), message
    assert "allreduce of gradients (DistributedOptimizer)" in message, message
    assert "running Python code" not in message, message
    assert_collectives_work(shell, capsys)
