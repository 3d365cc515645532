"""Watching and ending the processes of a cluster (mpiexec, ranks, controller) with psutil.

The notebook side never trusts that a process ended because it was asked to: it checks pids,
and kills what is still there, so that nothing of a cluster is left running.
"""

from __future__ import annotations

import socket
import time

import psutil


def alive(proc) -> bool:
    """Running and not a zombie (a child that exited but was not reaped yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_here(info: dict) -> bool:
    """Whether a rank (its info) runs on this host: elsewhere its pid means another process."""
    return info["host"] == socket.gethostname()


def local_process(info: dict):
    """The psutil process of a rank on this host; None for a rank on another host."""
    return process(info["pid"]) if is_here(info) else None


def process(pid: int):
    """The psutil process of ``pid`` on this host, or a stand-in that is not running."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return _Gone()


class _Gone:
    """Stands for a local rank whose pid no longer exists."""

    def is_running(self) -> bool:
        return False


def exit_code(proc) -> int | None:
    """A process's exit code once it has exited (psutil remembers it after the reaping wait)."""
    try:
        return proc.wait(0)
    except (psutil.Error, psutil.TimeoutExpired):
        return None


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def reap(pids: list[int], grace: float = 5.0) -> None:
    """Wait for ``pids`` to exit; SIGKILL any still there after ``grace`` seconds."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _kill_after(procs, grace)


def end(procs: list[psutil.Process], grace: float = 3.0) -> None:
    """SIGTERM ``procs``; SIGKILL any still there after ``grace`` seconds."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _kill_after(procs, grace)


def _kill_after(procs: list[psutil.Process], grace: float) -> None:
    still = _wait(procs, grace)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait(still, grace)


def _wait(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """psutil.wait_procs, for processes that may go at any moment: a process that exits
    between two of psutil's looks can make it raise (``pidfd_open``: ENOENT), which must not
    abort a stop. Returns those still running."""
    try:
        return psutil.wait_procs(procs, timeout=timeout)[1]
    except (OSError, psutil.Error):
        deadline = time.monotonic() + timeout
        still = [p for p in procs if alive(p)]
        while still and time.monotonic() < deadline:
            time.sleep(0.05)
            still = [p for p in still if alive(p)]
        return still
