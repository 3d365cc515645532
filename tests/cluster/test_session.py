"""The Session API from plain Python, and the process lifecycle: stop and restart leave nothing."""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import psutil
import pytest
from helpers import as_merged, run_cell, wait_gone

import ipydist
from ipydist.errors import ClusterError, RankError
from ipydist.notebook.launch import processes
from ipydist.specs import SpecError


def cluster_pids(session) -> dict[str, list[int]]:
    """Every process the session started: engines, mpiexec, controller."""
    cluster = session.cluster
    return {
        "engines": [i["pid"] for i in session.ranks],
        "mpiexec": [cluster.launcher_pid],
        "controller": [cluster.controller_pid],
    }


def test_session_context_manager_runs_and_cleans_up(capsys):
    with ipydist.Session(np=2) as s:
        assert s.running and s.size == 2 and s.startup_seconds > 0
        pids = cluster_pids(s)
        assert all(psutil.pid_exists(p) for group in pids.values() for p in group)
        result = s.run("import ipydist.torch as hvd\nvalue = hvd.rank() + 1\nvalue * 100")
        assert result.ranks == [0, 1]
        assert result.execute_results[1]["data"]["text/plain"] == "200"
        assert s.pull("value") == [1, 2]
        assert s.pull("value", rank=1) == 2
        s.push(weights=[0.5, 0.25])
        s.run("total = sum(weights) * hvd.size()")
        assert s.pull("total") == [1.5, 1.5]
        # the rendezvous file lives in the cluster's profile folder, removed at the stop
        # (ranks end by signal: an atexit of rank 0's left a folder in /tmp per cluster)
        s.run("from ipydist.torch._core import topology\nstore = topology.get().store_path")
        store, profile = s.pull("store", rank=0), s.cluster.profile_dir
        assert store.startswith(profile + os.sep) and os.path.exists(store), (store, profile)
        assert [row[4] for row in s.status().rows] == ["idle", "idle"]
        running = threading.Thread(target=s.run, args=("import time; time.sleep(1.5)",))
        running.start()
        time.sleep(0.5)
        assert [row[4] for row in s.status().rows] == ["busy", "busy"]
        running.join()
        assert [row[4] for row in s.status().rows] == ["idle", "idle"]
        with pytest.raises(RankError) as info:
            s.run("assert hvd.rank() == 0, 'only rank 0 passes'")
        assert info.value.ranks == [1]
        # from plain Python, messages name Session's methods, not the magics
        with pytest.raises(NameError, match="'nope' is not defined on ranks 0-1: set it in "
                           r"code passed to Session\.run\(\) first"):
            s.pull("nope")
    out = capsys.readouterr().out
    assert "2 ranks ready in" in out
    assert not s.running
    left = wait_gone([p for group in pids.values() for p in group])
    assert left == [], f"left running after the with block: {left}"
    assert not os.path.exists(profile), "the profile folder, and the rendezvous file in it"
    with pytest.raises(ClusterError,
                       match=r"no cluster is running: start one with Session\(np=N\)\.start\(\)"):
        s.run("pass")


def test_dist_stop_ends_every_process(shell, capsys, no_cluster, magics, tmp_path):
    result, out, _ = run_cell(shell, capsys, "%dist_start --np 2")
    assert result.error_in_exec is None
    assert out.splitlines()[0].split() == ["rank", "host", "pid", "device", "backend",
                                           "transport"]
    pids = cluster_pids(magics.session)
    # the controller's schedulers, forked from it: once left running by a controller that
    # was SIGKILLed when its grace ran out (issue 46)
    pids["controller's children"] = [
        p.pid for p in psutil.Process(pids["controller"][0]).children(recursive=True)]
    # A rank ends without tearing Python down (ipydist/rank/ending.py), yet as Python's exit
    # would be seen: a file left open keeps what was written, atexit callbacks run, even one
    # that takes a second (mpiexec, told to end the job, killed ranks half a second in).
    result, out, err = run_cell(shell, capsys, f"""%%everyrank
import atexit, os, time, ipydist.torch as hvd
_kept = open(os.path.join({str(tmp_path)!r}, f"open-{{hvd.rank()}}.txt"), "w")
_kept.write("written, never closed")
atexit.register(lambda: (time.sleep(1), open(os.path.join({str(tmp_path)!r},
                                                          f"atexit-{{hvd.rank()}}"), "w")
                                        .write("ran")))""")
    assert result.error_in_exec is None, (out, err)
    result, out, err = run_cell(shell, capsys, "%dist_stop")
    assert "Stopped 2 ranks." in out
    assert "finalize" not in out + err, "MPI finalized on every rank"
    for group, group_pids in pids.items():
        assert wait_gone(group_pids) == [], f"{group} still running"
    for rank in range(2):
        assert (tmp_path / f"open-{rank}.txt").read_text() == "written, never closed"
        assert (tmp_path / f"atexit-{rank}").read_text() == "ran"
    _, out, _ = run_cell(shell, capsys, "%dist_stop")
    assert "No cluster is running." in out


def test_ranks_asked_to_end_end_cleanly(no_cluster):
    """A SIGTERM is how a rank is asked to end (the stop sends it; mpiexec and Slurm forward
    it): each rank ends with exit code 0 and says nothing, so mpiexec sees its job end well.
    ipyparallel's engine ended with a traceback and code 1, and mpiexec then killed the ranks
    still in MPI's finalize."""
    with ipydist.Session(np=2) as s:
        s.cluster.signal(signal.SIGTERM)
        output = s.cluster.launcher_output(wait_for_exit=30)
        assert processes.exit_code(s.cluster.launcher_process()) == 0, output
        assert "Traceback" not in output


def test_ranks_whose_mpiexec_is_killed_end_by_themselves(shell, capsys, no_cluster, magics):
    """mpiexec SIGKILLed (as Slurm's step end or an OOM killer does) cannot end its ranks:
    each rank sees its launcher gone and ends itself (issue 46: a rank outlived its job)."""
    run_cell(shell, capsys, "%dist_start --np 2")[0].raise_error()
    pids = cluster_pids(magics.session)
    # mpiexec's session folder (PMIx's sockets) is in the cluster's own folder, not the temp
    # folder's ompi.<pid>, where a killed mpiexec left it to fail a later one with its pid
    session = os.path.join(magics.session.cluster.profile_dir, f"ompi.{pids['mpiexec'][0]}")
    assert os.path.isdir(session)
    try:
        psutil.Process(pids["mpiexec"][0]).kill()
        assert wait_gone(pids["engines"], timeout=5) == [], "ranks ran 5 s after mpiexec died"
    finally:
        run_cell(shell, capsys, "%dist_stop")
    assert wait_gone([p for group in pids.values() for p in group]) == []
    assert not os.path.exists(session)
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), f"ompi.{pids['mpiexec'][0]}"))


def test_dist_restart_replaces_every_process(shell, capsys, no_cluster, magics):
    run_cell(shell, capsys, "%dist_start --np 2")[0].raise_error()
    old = cluster_pids(magics.session)
    try:
        result, out, _ = run_cell(shell, capsys, "%dist_restart")
        assert result.error_in_exec is None
        assert "2 ranks ready in" in out
        new = cluster_pids(magics.session)
        assert not set(new["engines"]) & set(old["engines"])
        assert wait_gone([p for group in old.values() for p in group]) == []
        _, out, _ = run_cell(
            shell, capsys, "%everyrank import ipydist.torch as hvd; print(hvd.size())"
        )
        assert "[all ranks] 2" in as_merged(out, 2)
    finally:
        shell.run_cell("%dist_stop")


def test_no_init_leaves_the_process_group_to_user_code(capsys):
    with ipydist.Session(np=2, init=False) as s:
        out, err = capsys.readouterr()
        assert "torch imported · torchrun env set · engines registered" in err, err
        assert "process group" not in err + out
        assert " · torchrun env " in out, "the seconds of each step, under the table"
        s.run(
            "import os, torch, torch.distributed as dist\n"
            "before = dist.is_initialized()\n"
            "dist.init_process_group('gloo')  # env:// from the torchrun variables\n"
            "t = torch.ones(1); dist.all_reduce(t)\n"
            "got = (before, t.item(), os.environ['RANK'], os.environ['WORLD_SIZE'])"
        )
        assert s.pull("got") == [(False, 2.0, "0", "2"), (False, 2.0, "1", "2")]
        assert [r["backend"] for r in s.ranks] == ["(none)", "(none)"]


def test_transport_gloo_puts_cpu_collectives_back_on_the_process_group(capsys):
    with pytest.raises(SpecError, match="--transport tcp: expected auto"):
        ipydist.Session(np=2, transport="tcp")
    with ipydist.Session(np=2, transport="gloo") as s:
        assert [r["transport"] for r in s.ranks] == ["gloo", "gloo"]
        s.run("import torch, ipydist.torch as hvd\n"
              "from ipydist.torch._wire import transport\n"
              "t = torch.ones(3)\n"
              "wire = transport.uses_mpi(t)\n"
              "total = hvd.allreduce(t, op=hvd.Sum).tolist()")
        assert s.pull("wire") == [False, False]
        assert s.pull("total") == [[2.0] * 3] * 2


#: Put in a rank's path by the test below: rank 1's process crashes as Open MPI's race in
#: MPI_Init does (open-mpi/ompi#12495), with the report Open MPI prints; IPYDIST_TEST_CRASH says
#: when: "once:FILE" (the first time, leaving FILE) or "always".
_CRASH_IN_MPI_INIT = """
import os, signal, sys
when = os.environ.get("IPYDIST_TEST_CRASH", "")
first = when.startswith("once:") and not os.path.exists(when[5:])
if os.environ.get("OMPI_COMM_WORLD_RANK") == "1" and (first or when == "always"):
    if first:
        open(when[5:], "w").close()
    sys.stderr.write(
        "[vm:00042] *** Process received signal ***\\n"
        "[vm:00042] Signal: Segmentation fault (11)\\n"
        "[vm:00042] [ 0] /lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7f7c2c65a050]\\n"
        "[vm:00042] [ 1] libmpi.so.40(mca_pml_ob1_recv_frag_callback_match+0x95)[0x7f7c2ae7]\\n"
        "[vm:00042] [ 2] libmpi.so.40(ompi_mpi_init+0x425)[0x7f7c2ac91215]\\n"
        "[vm:00042] *** End of error message ***\\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSEGV)
"""


def test_a_start_whose_rank_crashed_inside_mpi_init_is_tried_again_once(tmp_path, capsys):
    """A crash inside MPI_Init is MPI's own race (no code of the rank ran yet): the start is
    tried again, once, saying why; another failed start is not (tests/cluster/test_bad_input
    .py), nor a crash there a second time."""
    (tmp_path / "sitecustomize.py").write_text(_CRASH_IN_MPI_INIT)
    marker = tmp_path / "crashed"
    env = {"PYTHONPATH": str(tmp_path), "IPYDIST_TEST_CRASH": f"once:{marker}"}
    with ipydist.Session(np=2, env=env) as s:
        assert marker.exists()  # the first start met the crash
        assert s.run("6 * 7").execute_results[1]["data"]["text/plain"] == "42"
    out = capsys.readouterr().out
    assert out.count("a rank crashed inside MPI_Init") == 1, out
    assert "open-mpi/ompi#12495" in out and "2 ranks ready in" in out, out
    env["IPYDIST_TEST_CRASH"] = "always"
    with pytest.raises(ClusterError, match="ompi_mpi_init"):
        ipydist.Session(np=2, env=env).start()
    assert capsys.readouterr().out.count("a rank crashed inside MPI_Init") == 1
