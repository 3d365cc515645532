"""Ranks forked from one fork server per host (``ipydist.rank.start.forkserver``, issue 46): what
mpiexec starts stands in for its rank, the server imports torch once and ends with the last
rank, and a rank ends with the process mpiexec started for it, whatever ended that."""

from __future__ import annotations

import os
import signal

import psutil
from helpers import run_cell, wait_gone

from ipydist.errors import RankDied

SERVER = "ipydist.rank.start.forkserver"


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _servers(session) -> set[int]:
    return {psutil.Process(info["pid"]).ppid() for info in session.ranks}


def test_ranks_are_forked_from_one_server_and_draw_their_own_random_numbers(
        shell, capsys, cluster):
    servers = _servers(cluster)
    assert len(servers) == 1, f"one server per host, found the ranks' parents {servers}"
    assert SERVER in _cmdline(servers.pop())
    for info in cluster.ranks:
        stub = info["launched_pid"]
        assert stub != info["pid"], info
        assert SERVER not in _cmdline(stub) and "-m ipydist.rank" in _cmdline(stub), info
        assert psutil.Process(stub).ppid() != psutil.Process(info["pid"]).ppid()
    # Forked from one process, each rank still seeds numpy's and Python's generators anew,
    # as a fresh process does.
    result, out, err = run_cell(shell, capsys, "%everyrank import numpy, random; "
                                "_draws = (float(numpy.random.rand()), random.random())")
    assert result.error_in_exec is None, (out, err)
    draws = shell.run_line_magic("dist_pull", "_draws")
    assert len({d[0] for d in draws}) == len(draws), draws
    assert len({d[1] for d in draws}) == len(draws), draws


def test_a_rank_ends_with_its_stub_and_a_dead_server_stops_nothing(shell, capsys, magics,
                                                                   no_cluster):
    shell.run_cell("%dist_start --np 3").raise_error()
    session = magics.session
    try:
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


def test_ranks_keep_their_binding_the_server_ends_with_them_and_can_be_turned_off(
        shell, magics, no_cluster):
    shell.run_cell("%dist_start --np 2").raise_error()
    (server,) = _servers(magics.session)
    # Open MPI binds each of 2 ranks to a core of its own: the process it started was bound,
    # and the rank forked for it is bound alike (not as the server, which the first one
    # started).
    for info in magics.session.ranks:
        stub = psutil.Process(info["launched_pid"]).cpu_affinity()
        assert psutil.Process(info["pid"]).cpu_affinity() == stub, info
    magics.session.stop(quiet=True)
    magics.session = None
    assert wait_gone([server], 10) == [], "the fork server outlived its cluster"

    shell.run_cell("%dist_start --np 2 --env IPYDIST_FORKSERVER=0").raise_error()
    try:
        for info in magics.session.ranks:
            assert info["launched_pid"] == info["pid"], info
            assert SERVER not in _cmdline(psutil.Process(info["pid"]).ppid())
    finally:
        magics.session.stop(quiet=True)
        magics.session = None
