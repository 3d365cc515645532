"""No request is ever waited on forever (issue 12, item 2).

- a rank's reply lost on the way: the cell ends naming the rank, and the next cell works;
- a rank released before it began the cell (it was busy): it never runs the cell later, alone;
- a rank that ignores its release: the cell ends anyway, the next cell says the rank is busy
  instead of queueing behind it, and once it is idle the ranks recover before the next cell;
- recovery is collective with deadlines: over real mpiexec, a rank that never joins makes
  every other rank give up by the deadline, the group is dropped everywhere (collectives then
  say to restart), and a later agreement is not confused by the abandoned one's messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import (
    CHECK_NEXT_CELL,
    NP,
    as_merged,
    assert_collectives_work,
    rendered_alone,
    run_cell,
)

from ipydist.errors import CellTimeout, ReplyLost
from ipydist.notebook import cell
from ipydist.notebook.failures import recovery
from ipydist.notebook.launch import mpiexec


@pytest.fixture
def ranks(cluster, shell, capsys):
    run_cell(shell, capsys, "%everyrank import signal, time, torch, ipydist.torch as hvd")
    return cluster


def test_a_lost_reply_ends_the_cell_naming_the_rank(ranks, shell, capsys):
    # rank 3's kernel drops the next cell's execute_reply, as an interrupt inside ipykernel's
    # send did (this cell's own reply goes out)
    result, _, err = run_cell(shell, capsys, textwrap.dedent("""\
        %%everyrank
        if hvd.rank() == 3:
            _kernel = get_ipython().kernel
            _send = _kernel.session.send
            _replies = []
            def _drop_reply(stream, msg_or_type, *args, **kwargs):
                kind = msg_or_type if isinstance(msg_or_type, str) else msg_or_type["msg_type"]
                if kind == "execute_reply":
                    _replies.append(kind)
                    if len(_replies) == 2:
                        _kernel.session.send = _send
                        return None
                return _send(stream, msg_or_type, *args, **kwargs)
            _kernel.session.send = _drop_reply
        """))
    assert result.error_in_exec is None, err
    t0 = time.monotonic()
    result, out, err = run_cell(shell, capsys, "%everyrank print('done', hvd.rank())")
    elapsed = time.monotonic() - t0
    error = result.error_in_exec
    assert isinstance(error, ReplyLost), (error, err)
    assert str(error).startswith("rank 3 finished the cell, but its reply never reached"), error
    assert rendered_alone(error) == f"ReplyLost: {error}"
    assert "[rank 3] done 3" in out, "what it printed still shows"
    assert elapsed < cell.REPLY_LOST_SECONDS + 3, f"took {elapsed:.1f} s"
    assert ranks.cluster.busy_ranks(list(range(NP))) == [], "the lost reply is not waited for"
    assert_collectives_work(shell, capsys)


def test_a_rank_released_before_it_began_never_runs_the_cell_later(ranks, shell, capsys):
    # another client keeps rank 1 busy, so the cell queues there; --timeout releases the cell
    # before rank 1 began it: rank 1 must skip it, not run it alone once free (and hang there)
    other = ranks.cluster._ipp.connect_client_sync()
    try:
        busy = other[1].apply_async(time.sleep, 3)
        t0 = time.monotonic()
        result, _, err = run_cell(shell, capsys, textwrap.dedent("""\
            %%everyrank --timeout 1
            while True:
                hvd.allreduce_(torch.ones(4))
            """))
        elapsed = time.monotonic() - t0
        busy.get(timeout=10)
    finally:
        other.close()
    error = result.error_in_exec
    assert isinstance(error, CellTimeout), (error, err)
    assert elapsed < 1 + 4 + 2, f"took {elapsed:.1f} s"
    time.sleep(1)
    assert ranks.cluster.busy_ranks(list(range(NP))) == [], "no rank runs the released cell"
    assert_collectives_work(shell, capsys)


def _listening_ports(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_a_rank_that_ignores_its_release_never_hangs_the_next_cell(ranks, shell, capsys):
    rank0_listens = _listening_ports(ranks.ranks[0]["pid"])
    t0 = time.monotonic()
    result, _, err = run_cell(shell, capsys, textwrap.dedent("""\
        %%everyrank --timeout 1
        if hvd.rank() == 1:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # code that ignores interrupts
            time.sleep(14)
        else:
            hvd.allreduce_(torch.ones(4))
        """))
    error = result.error_in_exec
    assert isinstance(error, CellTimeout), (error, err)
    wait = recovery.STOP_WAIT_SECONDS
    assert f"rank 1 did not stop within {wait:g} s of being released" in str(error), error
    assert time.monotonic() - t0 < 1 + wait + 2
    # the next cell does not queue behind rank 1: it says so
    result, _, _ = run_cell(shell, capsys, "%everyrank 1")
    assert "rank 1 is still running an earlier request" in str(result.error_in_exec)
    # once rank 1 is done, the ranks recover first, and collectives work
    while ranks.cluster.busy_ranks([1]) and time.monotonic() - t0 < 25:
        time.sleep(0.2)
    result, out, err = run_cell(shell, capsys, CHECK_NEXT_CELL)
    assert result.error_in_exec is None, err
    assert "ipydist: before this cell: " in err and "process group was rebuilt" in err, err
    assert f"[all ranks] {float(sum(range(NP)))}" in as_merged(out), out
    # the rebuilt group met in the same rendezvous store: nothing new listens on rank 0 (gloo's
    # own listener for the new group is on loopback, and replaces none of the old ones)
    new = _listening_ports(ranks.ranks[0]["pid"]) - rank0_listens
    public = {c.laddr for c in psutil.Process(ranks.ranks[0]["pid"]).net_connections("inet")
              if c.status == psutil.CONN_LISTEN and c.laddr.port in new
              and c.laddr.ip not in ("127.0.0.1", "::1")}
    assert public == set(), f"rank 0 listens on {public} since the rebuild"


AGREE_SCRIPT = textwrap.dedent("""\
    import sys, time
    from mpi4py import MPI
    from ipydist.rank import consensus
    comm = MPI.COMM_WORLD.Dup()
    me = comm.Get_rank()
    t0 = time.monotonic()
    if me == 2:
        time.sleep(3)  # misses the first agreement, and joins it after the others gave up
    first = consensus.decide(comm, 7, 0, [me, 10 * me], time.monotonic() + 1.0)
    print(f"first {me} {first} {time.monotonic() - t0:.2f}", flush=True)
    comm.Barrier()
    second = consensus.decide(comm, 8, 0, [me, 10 * me], time.monotonic() + 5.0)
    print(f"second {me} {second}", flush=True)
""")

RECOVER_SCRIPT = textwrap.dedent("""\
    import time
    import torch
    from ipydist.rank import calls
    from ipydist.rank.start import bootstrap
    import ipydist.torch as hvd
    from ipydist.torch._core import process_group
    rt = bootstrap.bootstrap()
    calls.ARRIVE_SECONDS = 1.0
    hvd.allreduce(torch.ones(1))
    if rt.rank == 1:
        process_group.break_communication()  # as a release does
    if rt.rank == 2:
        time.sleep(2)  # still busy when the others recover
    t0 = time.monotonic()
    out = calls.recover(3, False)
    print(f"recover {rt.rank} {out.failed!r} {time.monotonic() - t0:.1f}", flush=True)
    try:
        hvd.allreduce(torch.ones(1))
    except RuntimeError as e:
        print(f"after {rt.rank} {e}", flush=True)
""")


def _mpirun(script: str, np: int, timeout: float) -> str:
    # not elastic: its hot spare would be one of the np processes, each of which is a rank
    plan = mpiexec.plan(mpiexec.find_mpiexec(), np, elastic=False)
    proc = subprocess.run(
        [plan.mpiexec, *plan.args, "-n", str(np), sys.executable, "-c", script],
        env={**os.environ, **plan.env}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_agreement_gives_up_by_its_deadline_on_every_rank_and_is_not_confused_later():
    out = _mpirun(AGREE_SCRIPT, 3, timeout=60)
    lines = {(line.split()[0], int(line.split()[1])): line for line in out.splitlines()}
    for me in range(3):
        first = lines[("first", me)].split()
        assert first[2] == "None", lines  # nobody heard all three in time
        if me != 2:
            assert float(first[3]) < 1.0 + 3.0 + 1.0, "gave up by the deadline (plus slack)"
            assert float(first[3]) >= 1.0, "and not before it"
        # the late vote of the abandoned agreement does not leak into the next one
        assert lines[("second", me)] == f"second {me} [[0, 0], [1, 10], [2, 20]]", lines


def test_a_recovery_a_rank_misses_is_abandoned_on_every_rank_and_says_restart():
    out = _mpirun(RECOVER_SCRIPT, 3, timeout=90)
    for me in range(3):
        recover = next(line for line in out.splitlines() if line.startswith(f"recover {me} "))
        assert "'not every rank joined the recovery in time'" in recover, out
        assert float(recover.split()[-1]) < 1.0 + 3.0 + 1.0, recover
        after = next(line for line in out.splitlines() if line.startswith(f"after {me} "))
        assert "could not be rebuilt: restart the cluster (%dist_restart)" in after, out


FAILED_START_SCRIPT = textwrap.dedent("""\
    import time
    from mpi4py import MPI
    from ipydist.rank import ending
    if MPI.COMM_WORLD.rank == 1:  # as a rank whose engine failed to start
        def engine():
            raise ValueError("no engine on rank 1")
        ending.run_then_exit(engine)
    time.sleep(60)  # rank 0: an engine serving on
""")


def test_a_rank_whose_engine_failed_ends_its_job_at_once():
    """Its end left MPI unfinalized: Open MPI's finalize waits for every rank, so the failed
    rank waited there while the others served, and a start waited out its --timeout (120 s,
    when a rank once read the controller's connection file half written)."""
    plan = mpiexec.plan(mpiexec.find_mpiexec(), 2, elastic=False)
    t0 = time.monotonic()
    proc = subprocess.run(
        [plan.mpiexec, *plan.args, "-n", "2", sys.executable, "-c", FAILED_START_SCRIPT],
        env={**os.environ, **plan.env}, capture_output=True, text=True, timeout=90)
    took = time.monotonic() - t0
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ValueError: no engine on rank 1" in proc.stderr, proc.stderr
    assert took < 30, f"the job lasted {took:.0f} s: the failed rank waited in MPI's finalize"
