"""Shared fixtures: a real IPython shell with ipydist loaded, and one 4-rank cluster for the
tests that only need *a* cluster (starting one costs seconds; most tests share it)."""

from __future__ import annotations

import re
import time

import psutil
import pytest

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NP = 4


def plain(text: str) -> str:
    """Text without terminal colour codes (rank tracebacks come coloured)."""
    return ANSI.sub("", text)


def cluster_processes() -> dict[int, str]:
    """pid -> cmdline of every ipydist engine, its mpiexec and ipydist-profile controller."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ipydist.engine" in cmd or ("ipydist-" in cmd and "ipyparallel" in cmd):
            found[p.info["pid"]] = cmd
    return found


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs; return those still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        left = [p for p in left if _running(p)]
        if left:
            time.sleep(0.1)
    return left


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(scope="session")
def shell():
    """The real IPython InteractiveShell that IPython's own tests use, with ipydist loaded."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "ipydist")
    yield ip
    magics = ip.magics_manager.registry["DistMagics"]
    if magics.session is not None:
        magics.session.stop(quiet=True)


@pytest.fixture
def magics(shell):
    return shell.magics_manager.registry["DistMagics"]


@pytest.fixture
def cluster(shell, magics):
    """A running 4-rank cluster in ``shell`` (started once, reused while it stays healthy)."""
    s = magics.session
    if s is None or not s.running or s.size != NP:
        if s is not None and s.running:
            s.stop(quiet=True)
        result = shell.run_cell(f"%dist_start --np {NP}")
        result.raise_error()
    return magics.session


@pytest.fixture
def no_cluster(shell, magics):
    """The shell with no cluster running, and a snapshot of cluster processes before the test."""
    if magics.session is not None and magics.session.running:
        magics.session.stop(quiet=True)
    magics.session = None
    return set(cluster_processes())


def run_cell(shell, capsys, code: str):
    """Run ``code`` as a cell; return (ExecutionResult, stdout, stderr), colours removed."""
    capsys.readouterr()
    result = shell.run_cell(code)
    out, err = capsys.readouterr()
    return result, plain(out), plain(err)
