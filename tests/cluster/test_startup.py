"""``%dist_start`` shows the steps of a start as they happen (issue 13, item 9): mpiexec
launched, torch imported, process group ready, engines registered, with the seconds so far.

The marker lines and the status line are pure logic, tested with a fake clock; then real
starts, in a terminal IPython shell (one line printed per step) and in a real Jupyter kernel
(one line redrawn in place, at most ten times a second).
"""

from __future__ import annotations

import re

from helpers import pulled, run_cell, run_ok
from jupyter_client.manager import start_new_kernel

from ipydist import protocol
from ipydist.notebook.launch.startup import StartWatch, as_shown

T0 = 100.0  # the fake perf_counter() at which the start began
LINE = re.compile(r"^Starting 2 ranks with [\w ]+ · (\d+\.\d) s: (.+)$")
ORDER = ["launching mpiexec", "mpiexec launched", "torch imported", "process group ready",
         "engines registered"]


class Lines:
    """Stands for ``display.Progress``: keeps every text it is given."""

    in_place = False  # as in a terminal: a line when a step begins or ends

    def __init__(self):
        self.texts: list[str] = []

    def update(self, text: str) -> None:
        self.texts.append(text)


def in_order(steps: list[str]) -> bool:
    """Whether each step of ORDER first shows up after the one before it."""
    firsts = [next(i for i, s in enumerate(steps) if label in s) for label in ORDER]
    return firsts == sorted(firsts)


def watch(np=2, init=True, live=True) -> StartWatch:
    return StartWatch(np, f"Starting {np} ranks with Open MPI", init, started=T0, live=live)


def marks(path, *pairs) -> None:
    with open(path, "a") as f:
        for rank, phase in pairs:
            f.write(protocol.phase_line(rank, phase) + "\n")


def test_marker_lines_are_found_behind_prefixes_mpiexec_adds():
    line = protocol.phase_line(3, protocol.PHASE_TORCH)
    assert protocol.parse_phase(line) == (3, "torch")
    assert protocol.parse_phase(f"[1,3]<stdout>:{line}") == (3, "torch")  # --tag-output
    assert protocol.parse_phase(f"[3] {protocol.phase_line(3, 'group')}") == (3, "group")
    assert protocol.parse_phase(f"{protocol.PHASE_MARKER} 3 toast") is None
    assert protocol.parse_phase("rank 3 imported torch") is None


def test_markers_are_left_out_of_the_output_users_see():
    output = (f"{protocol.phase_line(0, 'torch')}\nlibfoo: warning\n"
              f"[1,1]<stdout>:{protocol.phase_line(1, 'group')}\nprterun noticed ...\n")
    assert as_shown(output) == "libfoo: warning\nprterun noticed ...\n"
    assert as_shown("no markers\n") == "no markers\n"


def test_bytes_that_are_not_text_are_left_out_of_the_output_users_see():
    """Open MPI's help message once ended the launch error with a NUL byte (issue 46)."""
    output = "a help message\r\n-----\n\x00tab\there\x1b[1mbold\x07\n"
    assert as_shown(output) == "a help message\n-----\ntab\therebold\n"


def test_steps_are_shown_in_order_with_counts_and_seconds(tmp_path):
    out, w, lines = tmp_path / "out", watch(), Lines()
    out.write_text("")
    w.show(lines, None, [], now=T0, force=True)
    w.launched(now=T0 + 0.2)
    w.show(lines, str(out), [], now=T0 + 0.3)
    marks(out, (1, "torch"))
    w.show(lines, str(out), [], now=T0 + 2.5)
    marks(out, (0, "torch"), (0, "group"), (1, "group"))
    w.show(lines, str(out), [], now=T0 + 3.04)
    w.show(lines, str(out), [1], now=T0 + 3.9)
    w.show(lines, str(out), [0, 1], now=T0 + 4.0, force=True)
    assert [t.split(": ", 1)[1] for t in lines.texts] == [
        "launching mpiexec",
        "mpiexec launched · torch imported 0/2",
        "mpiexec launched · torch imported 1/2",
        "mpiexec launched · torch imported · process group ready · engines registered 0/2",
        "mpiexec launched · torch imported · process group ready · engines registered 1/2",
        "mpiexec launched · torch imported · process group ready · engines registered",
    ]
    assert [t.split(" s: ")[0].rsplit(" ", 1)[1] for t in lines.texts] == [
        "0.0", "0.3", "2.5", "3.0", "3.9", "4.0"]
    assert lines.texts[0].startswith("Starting 2 ranks with Open MPI · 0.0 s: ")


def test_a_line_counts_only_once_its_newline_came(tmp_path):
    out, w = tmp_path / "out", watch()
    line = protocol.phase_line(0, "torch") + "\n"
    out.write_text(line[:9])
    w.read(str(out), now=T0 + 1)
    assert w.seen["torch"] == {}
    with open(out, "a") as f:
        f.write(line[9:] + "some other output, no newline yet")
    w.read(str(out), now=T0 + 2)
    assert w.seen["torch"] == {0: 2.0}
    w.read(str(tmp_path / "removed"), now=T0 + 3)  # ipyparallel removes it after an exit
    assert w.seen["torch"] == {0: 2.0}


def test_a_later_step_counts_for_the_earlier_ones():
    """A marker that went missing (an mpiexec that drops ranks' stdout) hides nothing later."""
    w = watch()
    w.launched(now=T0)
    w.reached(1, "group", now=T0 + 1)
    w.engines([0], now=T0 + 2)
    w.reached(7, "torch", now=T0 + 2)  # not a rank of this cluster
    assert w.seen == {"torch": {0: 2.0, 1: 1.0}, "group": {0: 2.0, 1: 1.0}}
    assert w.text(now=T0 + 2).endswith("process group ready · engines registered 1/2")


def test_without_a_process_group_the_line_says_what_the_ranks_did_instead():
    w = watch(init=False)
    w.launched(now=T0)
    w.reached(0, "torch", now=T0 + 1)
    w.reached(1, "env", now=T0 + 1)
    assert w.text(now=T0 + 1).endswith("torch imported · torchrun env set 1/2")


def test_a_live_line_is_redrawn_at_most_ten_times_a_second():
    w, lines = watch(live=True), Lines()
    w.launched(now=T0)
    for i in range(500):  # the wait loop looks every 20 ms, for 10 s
        w.show(lines, None, [], now=T0 + i * 0.02)
    assert 50 <= len(lines.texts) <= 101
    assert float(LINE.match(lines.texts[-1]).group(1)) >= 9.8, "the seconds tick on"


def test_a_terminal_gets_a_line_only_when_a_step_begins_or_ends():
    w, lines = watch(np=4, live=False), Lines()
    w.launched(now=T0)
    for i in range(200):
        now = T0 + i * 0.05
        for rank in range(min(4, i // 20)):
            w.reached(rank, "torch", now)
        w.show(lines, None, [], now=now)
    assert [t.split(": ", 1)[1] for t in lines.texts] == [
        "mpiexec launched · torch imported 0/4",
        "mpiexec launched · torch imported · process group ready 0/4",
    ]


def test_a_start_that_timed_out_says_how_far_it_got():
    w = watch(np=4)
    assert w.so_far() == "launching mpiexec"
    w.launched(now=T0)
    w.reached(0, "torch")
    w.reached(2, "torch")
    assert w.so_far() == "mpiexec launched · torch imported 2/4 (not ranks 1 and 3)"
    w.engines([0, 1, 2, 3])
    w.reached(3, "group")  # engines registered implies the steps before
    assert w.so_far() == ("mpiexec launched · torch imported · process group ready · "
                          "engines registered")


def test_the_breakdown_gives_each_step_its_seconds():
    w = watch()
    w.launched(now=T0 + 0.2)
    w.reached(0, "torch", now=T0 + 2.0)
    w.reached(1, "torch", now=T0 + 3.2)
    assert w.breakdown() == ""  # not every step ended
    w.reached(0, "group", now=T0 + 3.2)
    w.reached(1, "group", now=T0 + 3.5)
    w.ready(now=T0 + 4.6)
    assert w.breakdown() == ("Start: launch 0.2 s · torch import 3.0 s · process group 0.3 s · "
                             "engine registration 1.1 s")


# --- real starts -------------------------------------------------------------------------------


def test_dist_start_in_a_terminal_prints_each_step_with_its_seconds(shell, capsys, no_cluster):
    result, out, err = run_cell(shell, capsys, "%dist_start --np 2")
    try:
        assert result.error_in_exec is None, err
        found = [LINE.match(ln) for ln in err.splitlines() if ln.startswith("Starting 2 ranks")]
        assert all(found) and len(found) >= 3, err
        seconds = [float(m.group(1)) for m in found]
        assert seconds == sorted(seconds) and seconds[0] < 5, err
        steps = [m.group(2) for m in found]
        assert in_order(steps), steps
        assert steps[-1] == " · ".join(ORDER[1:]), "the last line: every step done"
        assert protocol.PHASE_MARKER not in out + err
        assert re.search(r"^2 ranks ready in \d+\.\d s$", out, re.M), out
        assert re.search(r"^Start: launch \d+\.\d s · torch import \d+\.\d s · process group "
                         r"\d+\.\d s · engine registration \d+\.\d s$", out, re.M), out
        assert all(len(ln) <= 100 for ln in out.splitlines()), out
    finally:
        shell.run_cell("%dist_stop")


def test_dist_start_in_a_notebook_redraws_one_line_then_shows_the_table():
    km, kc = start_new_kernel(kernel_name="python3")
    messages = []
    try:
        # as nbclient asks (no stdin), a front end that applies a display's updates
        reply = kc.execute_interactive("%load_ext ipydist\n%dist_start --np 2", timeout=120,
                                       output_hook=messages.append, allow_stdin=False)
        assert reply["content"]["status"] == "ok", messages
        kc.execute_interactive("%dist_stop", timeout=60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    shown = [(m["header"]["msg_type"], m["content"]) for m in messages
             if m["header"]["msg_type"] in ("display_data", "update_display_data", "stream")]
    kinds = [k for k, _ in shown]
    first = kinds.index("display_data")
    assert kinds.count("update_display_data") >= 3, kinds
    redraws = [c["data"]["text/plain"] for k, c in shown if k == "update_display_data"]
    assert redraws[-1] == "", "the line is cleared: the table replaces it"
    texts = [shown[first][1]["data"]["text/plain"], *redraws[:-1]]
    found = [LINE.match(t) for t in texts]
    assert all(found), texts
    seconds = [float(m.group(1)) for m in found]
    assert seconds == sorted(seconds)
    # at most ten redraws a second (and one more for each step that begins)
    assert len(texts) <= 10 * (seconds[-1] - seconds[0]) + 8, (len(texts), seconds)
    assert in_order([m.group(2) for m in found]), texts
    ids = {c.get("transient", {}).get("display_id") for k, c in shown if k != "stream"}
    assert len(ids - {None}) == 1, "one line, redrawn in place"
    table = next(c for k, c in shown[first + 1:] if k == "display_data")
    assert "<caption>2 ranks ready in " in table["data"]["text/html"]
    printed = "".join(c["text"] for k, c in shown if k == "stream")
    assert "Start: launch " in printed and protocol.PHASE_MARKER not in printed


def test_ranks_that_wait_for_a_slow_one_sleep_instead_of_spinning(shell, capsys, cluster):
    """Where a rank is far behind (a replacement importing torch, the slowest import at a
    start), the others meet it asleep (``bootstrap.meet_without_spinning``), leaving it the
    cores, where MPI's blocking barrier spins them: a rank's CPU time over the wait is a small
    part of the wait for the meeting, and most of it for the barrier, on the same ranks."""
    run_ok(shell, capsys, """%%everyrank
import time
from mpi4py import MPI
from ipydist.rank.start.bootstrap import meet_without_spinning
_comm = MPI.COMM_WORLD.Dup()
def _waited(wait):
    _comm.Barrier()
    if _comm.rank == _comm.size - 1:
        time.sleep(2.0)  # far behind
    wall, cpu = time.perf_counter(), time.process_time()
    wait(_comm)
    return time.perf_counter() - wall, time.process_time() - cpu
_meet = _waited(meet_without_spinning)
_barrier = _waited(lambda c: c.Barrier())
_comm.Free()
""")
    meets, barriers = pulled(shell, "_meet")[:-1], pulled(shell, "_barrier")[:-1]
    for (wall, cpu), (barrier_wall, _) in zip(meets, barriers):
        assert wall > 1.5 and barrier_wall > 1.5, (meets, barriers)  # they did wait
        assert cpu < 0.15 * wall, (meets, barriers)
    # the barrier, on ranks that share 2 cores, spins one of them at the least
    assert sum(cpu for _, cpu in barriers) > 3 * sum(cpu for _, cpu in meets), (meets, barriers)


def test_a_start_whose_controller_ends_is_tried_again_once(no_cluster, capsys):
    """ipyparallel's controller chooses its ports by binding port 0 and closing the socket,
    then binds them again: on a busy machine another process may take one in between, and the
    controller ends (seen once in a full run: the ranks waited 35 s for its heartbeats, and
    the start failed). Killed here as soon as it runs: the start is tried again, once, saying
    so, at once, and the second start's ranks run a cell."""
    import os
    import signal
    import threading
    import time

    import ipydist

    session = ipydist.Session(np=2)
    killed: list[int] = []

    def kill_the_first_controller() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            cluster = session.cluster
            pid = cluster.controller_pid if cluster is not None else None
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_first_controller)
    killer.start()
    try:
        started = time.monotonic()
        session.start()
        took = time.monotonic() - started
        killer.join()
        out = capsys.readouterr().out
        assert killed and session.cluster.controller_pid != killed[0]
        assert "the ipyparallel controller ended or did not answer during the start" in out, out
        assert took < 30, f"{took:.1f} s: the lost controller was not seen at once"
        session.run("x = 1")
        assert session.pull("x") == [1, 1]
    finally:
        killer.join()
        session.stop(quiet=True)
