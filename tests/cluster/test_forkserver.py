"""Ranks forked from one fork server per host (``ipydist.rank.start.forkserver``, issue 46): what
mpiexec starts stands in for its rank, the server imports torch once, the notebook keeps the
one on its host for its next cluster (one a cluster's stub started ends with the last rank),
and a rank ends with the process mpiexec started for it, whatever ended that."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from helpers import run_cell, wait_gone

from ipydist import protocol
from ipydist.errors import RankDied
from ipydist.notebook.launch import kept_forkserver

SERVER = protocol.FORKSERVER_MODULE


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _servers(session) -> set[int]:
    return {psutil.Process(info["pid"]).ppid() for info in session.ranks}


def test_ranks_are_forked_from_one_server(cluster):
    servers = _servers(cluster)
    assert len(servers) == 1, f"one server per host, found the ranks' parents {servers}"
    assert SERVER in _cmdline(servers.pop())
    for info in cluster.ranks:
        stub = info["launched_pid"]
        assert stub != info["pid"], info
        assert SERVER not in _cmdline(stub) and "-m ipydist.rank" in _cmdline(stub), info
        assert psutil.Process(stub).ppid() != psutil.Process(info["pid"]).ppid()

    # the server formatted a traceback once before forking: no rank warms the formatter up
    cluster.run("import sys\n"
                "from ipydist.rank import released_errors\n"
                "warm = [all(n in sys.modules for n in released_errors.FORMATTER_MODULES),\n"
                "        released_errors.warmed_here]")
    assert cluster.pull("warm") == [[True, False]] * cluster.size

    # what the server imported is out of the ranks' garbage collections (it froze it before
    # forking), and torch's operator libraries are not unregistered at a rank's end
    cluster.run("import gc, weakref, torch.library\n"
                "frozen = gc.get_freeze_count()\n"
                "torch_ones = [f for f in weakref.finalize._registry  # (frozen: not in gc's)\n"
                "              if f.peek()[1] is torch.library._del_library]\n"
                "kept = [len(torch_ones), sum(f.atexit for f in torch_ones)]")
    for frozen in cluster.pull("frozen"):
        assert frozen > 100_000, f"the server froze {frozen} objects"
    for libraries, at_exit in cluster.pull("kept"):
        assert libraries > 100 and at_exit == 0, (libraries, at_exit)


def test_forked_ranks_draw_their_own_random_numbers_and_end_with_their_stubs(
        shell, capsys, magics, no_cluster):
    """A fresh cluster: the shared one's generators are whatever earlier tests seeded (the
    Hugging Face Trainer seeds every rank with 42, and CI once saw four equal draws)."""
    shell.run_cell("%dist_start --np 3 --no-elastic").raise_error()  # a death ends the job
    session = magics.session
    try:
        # Forked from one process, each rank still seeds numpy's and Python's generators
        # anew, as a fresh process does.
        result, out, err = run_cell(shell, capsys, "%everyrank import numpy, random; "
                                    "_draws = (float(numpy.random.rand()), random.random())")
        assert result.error_in_exec is None, (out, err)
        draws = shell.run_line_magic("dist_pull", "_draws")
        assert len({d[0] for d in draws}) == len(draws), draws
        assert len({d[1] for d in draws}) == len(draws), draws

        # A rank ends with its stub, and a dead server stops nothing.
        (server,) = _servers(session)
        os.kill(server, signal.SIGKILL)
        assert wait_gone([server], 5) == []
        result, out, err = run_cell(shell, capsys, "%everyrank import torch, torch.distributed "
                                    "as d; _t = torch.ones(1); d.all_reduce(_t)")
        assert result.error_in_exec is None, (out, err)
        assert shell.run_line_magic("dist_pull", "_t.item()") == [3.0] * 3

        victim = session.ranks[2]
        os.kill(victim["launched_pid"], signal.SIGKILL)
        assert wait_gone([victim["pid"]], 5) == [], "the rank outlived its stub by 5 s"
        result, out, err = run_cell(shell, capsys, "%everyrank _t.item()")
        assert isinstance(result.error_in_exec, RankDied), (result.error_in_exec, out, err)
        assert "rank 2" in str(result.error_in_exec), str(result.error_in_exec)
    finally:
        pids = [p for info in session.ranks for p in (info["pid"], info["launched_pid"])]
        session.stop(quiet=True)
        magics.session = None
    assert wait_gone(pids, 10) == []


def test_a_rank_whose_python_cannot_run_is_ended_by_the_server_when_its_stub_goes(
        shell, capsys, magics, no_cluster):
    """A rank stuck in a C call that holds the GIL cannot see its stub go (Open MPI deadlocked
    so in its finalize after a heal, and the rank outlived its job): the server kills it
    when its own end does not come (forkserver.STUB_GONE_GRACE_SECONDS)."""
    shell.run_cell("%dist_start --np 2").raise_error()
    session = magics.session
    try:
        result, out, err = run_cell(shell, capsys, """%%everyrank --ranks 1
import ctypes, threading, time
threading.Thread(target=lambda: (time.sleep(0.5), ctypes.PyDLL(None).sleep(600)),
                 daemon=True).start()""")
        assert result.error_in_exec is None, (out, err)
        time.sleep(1.5)  # the thread holds the GIL by now
        victim = session.ranks[1]
        assert psutil.Process(victim["pid"]).status() != psutil.STATUS_ZOMBIE
        os.kill(victim["launched_pid"], signal.SIGKILL)
        assert wait_gone([victim["pid"]], 10) == [], "the rank outlived its stub by 10 s"
    finally:
        pids = [p for info in session.ranks for p in (info["pid"], info["launched_pid"])]
        session.stop(quiet=True)
        magics.session = None
    assert wait_gone(pids, 10) == []


def test_ranks_keep_their_binding_and_the_kept_server_serves_the_next_start(
        shell, magics, no_cluster):
    shell.run_cell("%dist_start --np 2").raise_error()
    (server,) = _servers(magics.session)
    assert server in kept_forkserver.running(), "the server on this host is the kept one"
    assert psutil.Process(server).ppid() == os.getpid()
    # Open MPI binds each of 2 ranks to a core of its own: the process it started was bound,
    # and the rank forked for it is bound alike (not as the server, which the notebook
    # started).
    for info in magics.session.ranks:
        stub = psutil.Process(info["launched_pid"]).cpu_affinity()
        assert psutil.Process(info["pid"]).cpu_affinity() == stub, info
    ranks = [info["pid"] for info in magics.session.ranks]
    magics.session.stop(quiet=True)
    magics.session = None
    assert wait_gone(ranks, 10) == []
    assert psutil.Process(server).is_running() and not psutil.Process(server).children()

    shell.run_cell("%dist_start --np 2").raise_error()
    try:
        assert _servers(magics.session) == {server}, "the next start forks from the kept one"
    finally:
        magics.session.stop(quiet=True)
        magics.session = None

    shell.run_cell("%dist_start --np 2 --env IPYDIST_FORKSERVER=0").raise_error()
    try:
        for info in magics.session.ranks:
            assert info["launched_pid"] == info["pid"], info
            assert SERVER not in _cmdline(psutil.Process(info["pid"]).ppid())
    finally:
        magics.session.stop(quiet=True)
        magics.session = None


def test_a_server_named_for_one_cluster_ends_with_it(shell, magics, no_cluster):
    """A server a cluster's first stub starts (on other hosts, or named with --env) is that
    cluster's: it ends with its last rank."""
    shell.run_cell(f"%dist_start --np 2 --env IPYDIST_FORKSERVER=own{os.getpid()}").raise_error()
    try:
        (server,) = _servers(magics.session)
        assert server not in kept_forkserver.running()
    finally:
        magics.session.stop(quiet=True)
        magics.session = None
    assert wait_gone([server], 10) == [], "the fork server outlived its cluster"


def test_kept_servers_one_per_environment_end_with_their_owner(tmp_path):
    """A server is kept per environment (at most KEPT_MAX, the one used longest ago ended
    first), and ends with the process that keeps it, SIGKILL included."""
    owner = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from ipydist.notebook.launch import kept_forkserver as k
first = k.key_for({{"X_OF_TEST": "1"}})
assert k.key_for({{"X_OF_TEST": "1", "{protocol.RENDEZVOUS_PARENT_ENV}": "/elsewhere",
                  "PYTEST_CURRENT_TEST": "another", "OMPI_MCA_btl": "self"}}) == first
second = k.key_for({{"X_OF_TEST": "2"}})
(oldest,) = [p for p in k.running()][:1]
third = k.key_for({{"X_OF_TEST": "3"}})
assert len({{first, second, third}}) == 3 and len(k.running()) == k.KEPT_MAX
assert oldest not in k.running()
print(*k.running(), oldest, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        *kept, evicted = map(int, owner.stdout.readline().split())
        assert wait_gone([evicted], 10) == [], "the server used longest ago was not ended"
        assert all(psutil.pid_exists(pid) for pid in kept), kept
    finally:
        owner.kill()
        owner.wait()
    assert wait_gone(kept, 10) == [], "a kept server outlived its owner"
