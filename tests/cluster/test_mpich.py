"""MPICH as the MPI (the ``mpich`` extra). On one host its ranks start under
``mpiexec.gforker`` with shared memory only, so nothing of the cluster listens beyond loopback
(issue 36: Open MPI's launcher listens on every interface); collectives, a killed rank and a
restart work as they do under Open MPI.

``make test`` installs the ``mpich`` wheel in a prefix of its own (.venv/mpich: its ``mpiexec``
would replace Open MPI's in the venv), which ``--mpi`` names; ipydist points the ranks' mpi4py
at MPICH's library beside it.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from pathlib import Path

import psutil
import pytest
from helpers import (
    NP,
    assert_collectives_work,
    listening_beyond_loopback,
    pulled,
    run_cell,
    run_cell_killing_a_rank,
    wait_gone,
)

from ipydist.errors import RankDied
from ipydist.notebook.launch import kept_forkserver, processes

MPICH = Path(sys.executable).parent.parent / "mpich" / "bin"

pytestmark = pytest.mark.skipif(not (MPICH / "mpiexec.gforker").exists(),
                                reason="make test installs MPICH in .venv/mpich")


@pytest.fixture
def start_mpich(shell, capsys, magics, no_cluster):
    """``%dist_start`` with MPICH's ``mpiexec`` (or another of its launchers); stopped after
    the test, so that no later test finds an MPICH cluster and reuses it."""
    def start(launcher: str = "mpiexec"):
        result, out, err = run_cell(shell, capsys,
                                    f"%dist_start --np {NP} --mpi {MPICH / launcher}")
        assert result.error_in_exec is None, (out, err)
        run_cell(shell, capsys, "%everyrank import time, torch, ipydist.torch as hvd")
        return magics.session, out

    yield start
    if magics.session is not None:
        magics.session.stop(quiet=True)
    magics.session = None


def test_on_one_host_nothing_listens_beyond_loopback_and_collectives_work(shell, capsys,
                                                                          start_mpich):
    session, out = start_mpich()
    assert session.cluster.plan.command_name == "mpiexec.gforker", session.cluster.plan.command
    assert session.cluster.plan.title == "MPICH" and f"{NP} ranks ready" in out, out
    servers = {psutil.Process(info["pid"]).ppid() for info in session.ranks}
    assert len(servers) == 1 and not servers & set(kept_forkserver.running()), (
        "MPICH's ranks come from a fork server of the cluster's own, not the kept one")
    result, _, err = run_cell(shell, capsys, """%%everyrank
from mpi4py import MPI
from ipydist.torch._core import topology
_mpi = MPI.Get_library_version().split()[0]
_transport = topology.get().transport
_sum = hvd.allreduce(torch.arange(100_000.0), op=hvd.Sum)[-1].item()
""")
    assert result.error_in_exec is None, err
    assert pulled(shell, "_mpi") == ["MPICH"] * NP
    assert pulled(shell, "_transport") == ["mpi"] * NP, "collectives over MPICH itself"
    assert pulled(shell, "_sum") == [NP * 99_999.0] * NP
    assert_collectives_work(shell, capsys)
    assert listening_beyond_loopback(session.cluster.pids()) == []


def test_hydra_listens_on_every_interface_which_the_check_sees(shell, capsys, start_mpich):
    """The check above can fail: MPICH's other launcher, named, is used, and its PMI port is
    on 0.0.0.0."""
    session, _ = start_mpich("mpiexec.hydra")
    assert session.cluster.plan.command_name == "mpiexec.hydra"
    assert_collectives_work(shell, capsys)
    assert any(found.startswith("0.0.0.0:")
               for found in listening_beyond_loopback(session.cluster.pids()))


def test_a_killed_rank_is_reported_and_restart_starts_fresh(shell, capsys, start_mpich):
    """gforker interrupts the other ranks when one dies, which idle engines ignore: ipydist
    ends the job as mpiexec would, and reads how the rank died from gforker's report."""
    session, _ = start_mpich()
    job = [info["pid"] for info in session.ranks] + [session.cluster.launcher_process().pid]
    segments = processes.shared_memory(job)
    assert any(path.startswith("/dev/shm/mpich_shm_") for path in segments), segments
    result, elapsed, victim = run_cell_killing_a_rank(shell, capsys, session, rank=2)
    error = result.error_in_exec
    assert isinstance(error, RankDied), error
    assert elapsed < 5, f"reported {elapsed:.1f} s after the kill"
    assert str(error).startswith(
        f"rank 2 (pid {victim} on {session.ranks[2]['host']}) died: killed by signal 9 "
        "(SIGKILL)"), str(error)
    assert "mpiexec.gforker then stopped ranks 0-1 and 3" in str(error), str(error)
    assert wait_gone(job) == [], "the job ended: none of its processes keeps running"
    result, out, _ = run_cell(shell, capsys, "%dist_status")
    assert result.error_in_exec is None
    assert re.search(rf"^2\s+\S+\s+{victim}\s+\S+\s+died first: signal 9 \(SIGKILL\)", out,
                     re.MULTILINE), out
    result, _, err = run_cell(shell, capsys, "%dist_restart")
    assert result.error_in_exec is None, err
    left = [path for pid in job for path in glob.glob(f"/dev/shm/{pid}:*")]
    left += [path for path in segments if os.path.exists(path)]
    assert left == [], "the killed ranks' shared memory is removed with their cluster"
    run_cell(shell, capsys, "%everyrank import time, torch, ipydist.torch as hvd")
    assert_collectives_work(shell, capsys)
    assert shell.magics_manager.registry["DistMagics"].session.cluster.plan.command_name == \
        "mpiexec.gforker"
