"""Helpers the tests import (``tests`` is on pytest's ``pythonpath``): running a cell in the
shared shell, and finding the processes of ipydist clusters on this machine."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import time
import uuid

import psutil
import pytest

from ipydist import protocol
from ipydist.notebook.launch import kept_forkserver

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NP = 4

#: Runs that are too long for ``make test`` (which must end within about 25 minutes on 2 cores)
#: and whose parts have shorter tests there: ``make stress`` runs them (IPYDIST_TEST_STRESS=1).
STRESS = bool(os.environ.get("IPYDIST_TEST_STRESS"))
_skipped_by_make_test = pytest.mark.skipif(not STRESS, reason="a long run: make stress runs it")
#: How many times a failure test on a loaded machine runs its scenario: once in ``make test``
#: (the feature, tested); ``make stress`` repeats them (``IPYDIST_TEST_TRIALS=10``), since a
#: race shows in the repetitions, and the repetitions cost the suite its 15 minutes (issue 46).
TRIALS = int(os.environ.get("IPYDIST_TEST_TRIALS", "1"))


def stress(test):
    """Mark ``test`` as one of those runs: ``make test`` skips it, ``make stress`` selects it
    (``-m stress``)."""
    return pytest.mark.stress(_skipped_by_make_test(test))


def plain(text: str) -> str:
    """Text without terminal colour codes (rank tracebacks come coloured)."""
    return ANSI.sub("", text)


_TAGGED = re.compile(r"^\[rank (\d+)\] (.*)$")


def as_merged(text: str, np: int = NP) -> str:
    """``text`` with each line that all ``np`` ranks printed alike, tagged once per rank, in
    its merged form: one ``[all ranks]`` line where the first rank's copy was. The notebook
    merges the ranks' copies of a line only when they arrive within its wait (0.25 s, longer
    on a loaded machine), so a test that means "every rank printed this" must read both forms
    as one. (Lines merged already are left as they are.)"""
    lines = text.splitlines(keepends=True)
    tagged = [_TAGGED.match(ln.rstrip("\n")) for ln in lines]
    gone: set[int] = set()
    for i, m in enumerate(tagged):
        if m is None or i in gone:
            continue
        copies = {int(m.group(1)): i}
        for j in range(i + 1, len(lines)):
            other = tagged[j]
            if (other is not None and j not in gone and other.group(2) == m.group(2)
                    and int(other.group(1)) not in copies):
                copies[int(other.group(1))] = j
        if sorted(copies) == list(range(np)):
            lines[i] = f"[all ranks] {m.group(2)}" + ("\n" if lines[i].endswith("\n") else "")
            gone |= set(copies.values()) - {i}
    return "".join(ln for k, ln in enumerate(lines) if k not in gone)


def unwrapped(text: str) -> str:
    """``text`` with each run of spaces and line breaks made one space: ipydist wraps its
    messages (``errors.MESSAGE_WIDTH``), and where a line breaks moves with the length of a pid
    or a host's name, so a phrase is looked for in this (a test failed on a 5-digit pid)."""
    return " ".join(text.split())


#: Set in the environment of a kernel a test starts (and so of its cluster), so that a test
#: finds only its own processes, not another run's on the same machine.
#: Debian's Chromium, which the browser tests drive through Playwright (installed by
#: scripts/ensure-chromium.sh; Playwright never downloads a browser of its own here).
CHROMIUM = "/usr/bin/chromium"
#: Flags that keep Chromium off the network (no update, sync or field-trial requests) and working
#: as root in a container without a GPU.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

MARK_VAR = "IPYDIST_TEST_RUN"
#: This test process's own mark, which everything it starts inherits (mpiexec, ranks,
#: controllers, kernels): the suite runs in several processes at once (pytest-xdist), and a
#: test counts only its own process's clusters, never a neighbour's. A process that inherited
#: a mark (an xdist worker, a test run a test started) extends it, so that a run's marks all
#: begin with its first process's (:func:`of_this_run`), and another run on the machine is
#: never taken for this one's: the end-of-run sweep of one once killed the workers of another.
MARK_PREFIX = "pytest-"
_INHERITED = os.environ.get(MARK_VAR, "")
RUN_MARK = os.environ[MARK_VAR] = (f"{_INHERITED}-{os.getpid()}"
                                   if _INHERITED.startswith(MARK_PREFIX)
                                   else f"{MARK_PREFIX}{os.getpid()}")


def of_this_run(mark: str) -> bool:
    """Whether ``mark`` is this process's, or one a process it started made from it."""
    return mark == RUN_MARK or mark.startswith(RUN_MARK + "-")


def new_mark() -> str:
    """A mark for one test's own kernel and what it starts: told apart from the rest of this
    test process's (a test counts its kernel's processes), found by the suite's last check
    (:data:`RUN_MARK` begins it)."""
    return f"{RUN_MARK}-{uuid.uuid4().hex}"


#: In the command line of every rank and of the mpiexec that starts them.
RANK_COMMAND = "-m ipydist.rank"


def cluster_processes(mark: str | None = None, ranks_only: bool = False) -> dict[int, str]:
    """pid -> command line of the processes of ipydist clusters on this machine.

    Without ``mark``: every rank, its mpiexec, and every controller of an ipydist profile that
    this test process started (:data:`RUN_MARK`). With ``mark``: every process whose
    environment carries ``MARK_VAR=mark`` (a test's own kernel and whatever it started).
    ``ranks_only``: only ranks (and their mpiexec). The fork servers this process keeps
    between its clusters (``kept_forkserver``) are not a cluster's: they are left out.
    """
    kept = set(kept_forkserver.running())
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] in kept:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if ranks_only and RANK_COMMAND not in cmd:
            continue
        if mark is None and RANK_COMMAND not in cmd and not (
                "ipydist-" in cmd and "ipyparallel" in cmd):
            continue
        try:
            if p.environ().get(MARK_VAR) != (mark or RUN_MARK):
                continue
        except psutil.Error:
            continue
        found[p.info["pid"]] = cmd
    return found


def kept_forkservers(pids) -> set[int]:
    """Those of ``pids`` that are fork servers a notebook process keeps between its clusters
    (``kept_forkserver``; they end with that process): started with the owner's pipe and
    not forked from another server, as the ranks are (whose environment, as /proc shows it,
    is their server's)."""
    found = set()
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if (protocol.FORKSERVER_MODULE in " ".join(p.cmdline())
                    and protocol.FORKSERVER_OWNER_ENV in p.environ()
                    and protocol.FORKSERVER_MODULE not in " ".join(p.parent().cmdline())):
                found.add(pid)
        except (psutil.Error, AttributeError):  # gone; or no parent
            continue
    return found


def listening_beyond_loopback(pids: list[int]) -> list[str]:
    """What ``ss -ltnu`` would list for ``pids`` and their children on an address other than
    loopback, as "address:port (program)": a cluster on one host should list nothing."""
    procs = set()
    for pid in pids:
        try:
            parent = psutil.Process(pid)
            procs |= {parent, *parent.children(recursive=True)}
        except psutil.Error:
            pass
    found = []
    for proc in procs:
        try:
            name, sockets = proc.name(), proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for s in sockets:
            listening = s.status == psutil.CONN_LISTEN or (
                s.type == socket.SOCK_DGRAM and not s.raddr)
            if listening and not ipaddress.ip_address(s.laddr.ip).is_loopback:
                found.append(f"{s.laddr.ip}:{s.laddr.port} ({name})")
    return sorted(found)


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _running(p)]
        if left:
            time.sleep(0.1)
    return left


def kill_left(found: dict[int, str], timeout: float = 10.0) -> dict[int, str]:
    """Wait for the processes ``found`` (pid -> command line) to end; SIGKILL those still
    running after ``timeout`` and return them, so that a test can name them."""
    left = {pid: found[pid] for pid in wait_gone(found, timeout)}
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    return left


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


#: A cell whose output shows that collectives work on every rank (after a failure, a restart).
CHECK_NEXT_CELL = (
    "%everyrank print(hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item())"
)


def assert_collectives_work(shell, capsys):
    """Every rank prints the sum of the ranks (merged into one ``[all ranks]`` line, or one
    line each: :func:`as_merged`)."""
    result, out, err = run_cell(shell, capsys, CHECK_NEXT_CELL)
    assert result.error_in_exec is None, err
    assert f"[all ranks] {float(sum(range(NP)))}" in as_merged(out), out


def idle_cpu_and_retired_connections(session) -> tuple[list[float], list[tuple]]:
    """Per rank: CPU seconds it used over 2 s of idling (a spinning thread shows here), and
    (registered, armed): its replaced groups' connections still in an epoll set, and those
    of them that could still be reported (none once silenced: ``ipydist.torch._core.retired``)."""
    session.run("""
import time as _time
from ipydist.torch._core import retired as _r
_t = _time.process_time(); _time.sleep(2); _idle_cpu = _time.process_time() - _t
_kept = (_r.registered(), _r.armed())""")
    return session.pull("_idle_cpu"), session.pull("_kept")


def restart_and_check(shell, capsys, old_pids, imports: str) -> None:
    """``%dist_restart``; nothing of the old cluster keeps running; after ``imports``,
    collectives work on the new one."""
    result, _, err = run_cell(shell, capsys, "%dist_restart")
    assert result.error_in_exec is None, err
    assert wait_gone(old_pids) == [], "nothing of the old cluster keeps running"
    run_cell(shell, capsys, f"%everyrank {imports}")
    assert_collectives_work(shell, capsys)


def run_cell(shell, capsys, code: str, store_history: bool = False):
    """Run ``code`` as a cell; return (ExecutionResult, stdout, stderr), colours removed.
    ``store_history``: numbered, as a notebook's cells are."""
    capsys.readouterr()
    result = shell.run_cell(code, store_history=store_history)
    out, err = capsys.readouterr()
    return result, plain(out), plain(err)


def run_cell_killing_a_rank(shell, capsys, session, rank: int, after: float = 1.0):
    """Run a cell in which ``rank`` is killed with SIGKILL ``after`` seconds in (the others
    wait in a collective, then sleep); return (ExecutionResult, seconds from the kill to the
    end of the cell, the killed pid)."""
    import os
    import signal
    import threading

    victim = session.ranks[rank]["pid"]
    killer = threading.Timer(after, os.kill, (victim, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    result, _, _ = run_cell(shell, capsys,
                            "%everyrank hvd.allreduce_(torch.ones(2)); time.sleep(60)")
    elapsed = time.monotonic() - t0 - after
    killer.join()
    return result, elapsed, victim


def run_ok(shell, capsys, code):
    """Run a cell that must succeed; its stdout."""
    result, out, err = run_cell(shell, capsys, code)
    if result.error_in_exec is not None:
        raise AssertionError(f"{result.error_in_exec!r}\n{out}\n{err}")
    return out


def pulled(shell, name):
    """``%dist_pull name``: one value per rank of the NP-rank test cluster."""
    values = shell.run_line_magic("dist_pull", name)
    assert len(values) == NP
    return values


def rendered_alone(error) -> str:
    """An error IPython shows as its message alone (``RankDied``, ``CellTimeout``, ...): that
    message, checked to be wrapped at spaces to short lines, joined back into one."""
    from ipydist.errors import MESSAGE_WIDTH

    lines = error._render_traceback_()
    assert all(len(line) <= MESSAGE_WIDTH or " " not in line for line in lines), lines
    return " ".join(lines)


def one_line(text: str) -> str:
    """``text`` with every run of whitespace one space: a message as it reads, however it was
    wrapped (see ``ipydist.errors.wrap_message``)."""
    return re.sub(r"\s+", " ", text)


def cluster_tree(session) -> dict[int, str]:
    """pid -> command line of the cluster's controller, its mpiexec and everything under it
    (every rank it started, replacements and hot spares included): not the other clusters
    beside it."""
    found = {}
    for pid in session.cluster.pids():
        try:
            top = psutil.Process(pid)
            for p in [top, *top.children(recursive=True)]:
                found[p.pid] = " ".join(p.cmdline())
        except psutil.Error:
            continue
    return found
