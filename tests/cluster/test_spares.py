"""Hot spares (``--spares N``, issue 49): processes started with the job, torch imported, that
take a dead rank's place without a spawn.

Real ranks under ``mpiexec --with-ft ulfm`` on this host, MPI shared memory only: a spare
replaces a rank SIGKILLed in a collective (two at once, too), quiet and under CPU hogs, with
every rank's state kept; a grow takes a spare; once the spares are used up, a heal says so
and what to do. Neither ranks nor spares listen beyond loopback; cells see the ranks' world
as ``MPI.COMM_WORLD``; a stop ends the spares with the job, cleanly, and leaves no process.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from helpers import TRIALS, cluster_tree, run_cell, wait_gone

from ipydist.errors import RankDied
from ipydist.notebook.launch import processes

SETUP = """%%everyrank
import torch, ipydist.torch as hvd
from mpi4py import MPI
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
X = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        ((model(X) - X.sum(1, keepdim=True)) ** 2).mean().backward()
        opt.step()
def same_everywhere():
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return bool(hvd.allreduce(flat, op=hvd.Max).equal(hvd.allreduce(flat, op=hvd.Min)))
train(2)
kept = "defined before the kill"
"""
CHECK = """%%everyrank
train(2)
now = (hvd.size(), hvd.rank(), MPI.COMM_WORLD.Get_size(), kept, same_everywhere())
"""


def _listening_beyond_loopback(pids) -> list:
    """The listening sockets of ``pids`` bound to anything but loopback."""
    wide = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids and c.laddr.ip not in (
                "127.0.0.1", "::1"):
            wide.append((c.pid, c.laddr))
    return wide


def _start(shell, magics, capsys, options: str):
    result, out, err = run_cell(shell, capsys, f"%dist_start {options}")
    result.raise_error()
    return magics.session, out + err


def _stop(session) -> None:
    """Stop; then no process of the cluster (spares included) may be left."""
    tree = cluster_tree(session)
    session.stop(quiet=True)
    left = {pid: tree[pid] for pid in wait_gone(tree, 10)}
    assert not left, f"processes left after stopping: {left}"


def _kill_in_allreduce(shell, capsys, session, victims: list[int]) -> str:
    """SIGKILL ``victims`` while every rank runs allreduces; the cell's error message."""
    pids = [session.ranks[v]["pid"] for v in victims]
    killer = threading.Timer(1.0, lambda: [os.kill(p, signal.SIGKILL) for p in pids])
    killer.start()
    result, _, err = run_cell(shell, capsys, """%%everyrank
t = torch.ones(100)
while True:
    hvd.allreduce_(t)
""")
    killer.join()
    assert isinstance(result.error_in_exec, RankDied), (result.error_in_exec, err)
    return str(result.error_in_exec)


def test_spares_take_dead_ranks_places_then_say_they_are_used_up(shell, capsys, magics,
                                                                  no_cluster):
    session, said = _start(shell, magics, capsys, "--np 3 --spares 2")
    try:
        spares = list(session.cluster.spare_pids)
        assert len(spares) == 2 and "2 hot spares wait to take a dead rank's place" in said, said
        ranks = {r["pid"] for r in session.ranks}
        assert not _listening_beyond_loopback(ranks | set(spares))
        assert "tcp" not in " ".join(session.cluster.plan.args)
        result, out, _ = run_cell(shell, capsys, "%dist_status")
        assert "2 hot spares wait to take a dead rank's place" in out, out
        run_cell(shell, capsys, SETUP)[0].raise_error()
        # two ranks die at once: both spares take their places, their numbers kept
        _kill_in_allreduce(shell, capsys, session, [1, 2])
        result, _, err = run_cell(shell, capsys, CHECK)
        result.raise_error()
        assert "ranks 1-2 were replaced in" in err and "by hot spares (0 left)" in err, err
        assert sorted(r["pid"] for r in session.ranks[1:]) == sorted(spares)
        assert session.pull("now") == [(3, r, 3, "defined before the kill", True)
                                       for r in range(3)]
        assert session.cluster.spare_pids == ()
        # no spare left, and on one host no spawn: the heal says so, and what to do
        os.kill(session.ranks[1]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        result, _, err = run_cell(shell, capsys, "%everyrank x = 1")
        message = f"{result.error_in_exec} {err}"
        assert "Replacing rank 1 failed" in message and "no spare is left" in message, message
        assert "start with more --spares" in message and "%dist_restart" in message, message
    finally:
        _stop(session)
        magics.session = None


@pytest.mark.parametrize("trial", range(TRIALS))
def test_under_load_a_spare_replaces_a_killed_rank(shell, capsys, magics, no_cluster, hogs,
                                                   trial):
    session, _ = _start(shell, magics, capsys, "--np 2 --spares 1")
    try:
        spare = session.cluster.spare_pids[0]
        run_cell(shell, capsys, SETUP)[0].raise_error()
        _kill_in_allreduce(shell, capsys, session, [1])
        result, _, err = run_cell(shell, capsys, CHECK)
        result.raise_error()
        assert "rank 1 was replaced in" in err and "by a hot spare (0 left)" in err, err
        assert session.ranks[1]["pid"] == spare and session.ranks[1]["replacement"]
        assert session.pull("now") == [(2, r, 2, "defined before the kill", True)
                                       for r in range(2)]
    finally:
        _stop(session)
        magics.session = None


def test_a_grow_takes_a_spare_and_an_idle_spare_ends_cleanly_with_the_job(shell, capsys,
                                                                         magics, no_cluster):
    session, _ = _start(shell, magics, capsys, "--np 2 --spares 2")
    try:
        spares = list(session.cluster.spare_pids)
        run_cell(shell, capsys, SETUP)[0].raise_error()
        result, _, err = run_cell(shell, capsys, "%dist_scale --np 3")
        result.raise_error()
        assert "rank 2 started by a hot spare (1 left)" in err, err
        assert session.ranks[2]["pid"] == spares[0]
        result = run_cell(shell, capsys, CHECK)[0]
        result.raise_error()
        assert [now[:3] for now in session.pull("now")] == [(3, r, 3) for r in range(3)]
        result, _, err = run_cell(shell, capsys, "%dist_scale --np 5")
        assert "1 hot spare left" in str(result.error_in_exec), (result.error_in_exec, err)
        assert "scale to at most 4" in str(result.error_in_exec)
        # a spare that died unseen: the grow says so, and the ranks go on as they were
        os.kill(spares[1], signal.SIGKILL)
        assert wait_gone([spares[1]], 5) == []
        result, _, err = run_cell(shell, capsys, "%dist_scale --np 4")
        message = str(result.error_in_exec)
        assert "3 ranks -> 4: no spare is left" in message, (message, err)
        assert "goes on with its 3 ranks" in message and session.cluster.spare_pids == ()
        run_cell(shell, capsys, CHECK)[0].raise_error()
        assert [now[:3] for now in session.pull("now")] == [(3, r, 3) for r in range(3)]
    finally:
        _stop(session)
        magics.session = None
    # a job whose spares never served: rank 0 told them to leave, and they finalized with
    # the ranks (else the ranks would wait for them in MPI's finalize until killed)
    session, _ = _start(shell, magics, capsys, "--np 2 --spares 1")
    launcher = session.cluster._launcher().process
    try:
        run_cell(shell, capsys, "%everyrank from mpi4py import MPI; n = MPI.COMM_WORLD.Get_size()"
                 )[0].raise_error()
        assert session.pull("n") == [2, 2]
    finally:
        _stop(session)
        magics.session = None
    code = processes.exit_code(launcher)
    assert code == 0, f"mpiexec's job did not end cleanly: exit code {code}"


def test_asked_for_elastic_takes_the_spare_first_then_spawns(shell, capsys, magics, no_cluster):
    """``--elastic`` asked for on one host: the default spare, then spawned replacements over
    MPI's TCP transport, so that every death heals."""
    session, said = _start(shell, magics, capsys, "--np 2 --elastic")
    try:
        assert "1 hot spare waits" in said and "MPI's TCP transport" in said, said
        run_cell(shell, capsys, SETUP)[0].raise_error()
        for by in ("by a hot spare (0 left)", "(pid"):
            _kill_in_allreduce(shell, capsys, session, [1])
            result, _, err = run_cell(shell, capsys, CHECK)
            result.raise_error()
            assert "rank 1 was replaced in" in err and by in err, err
            assert session.pull("now") == [(2, r, 2, "defined before the kill", True)
                                           for r in range(2)]
        assert "hot spare" not in err.split("replaced in", 1)[1].split("(pid")[0]
    finally:
        _stop(session)
        magics.session = None
