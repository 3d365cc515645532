"""Watching and ending the processes of a cluster (mpiexec, ranks, controller) with psutil.

The notebook side never trusts that a process ended because it was asked to: it checks pids,
and kills what is still there, so that nothing of a cluster is left running.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
import time

import psutil

from ipydist.protocol import (
    HEAL_FILE_PREFIX,
    HEAL_SHARED_MEMORY,
    HEAL_SHARED_MEMORY_VARIABLE,
    RankInfo,
)


def alive(proc) -> bool:
    """Running and not a zombie (a child that exited but was not reaped yet)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_here(info: RankInfo) -> bool:
    """Whether a rank (its info) runs on this host: elsewhere its pid means another process."""
    return info.host == socket.gethostname()


def local_process(info: RankInfo):
    """The psutil process of a rank on this host; None for a rank on another host."""
    return process(info.pid) if is_here(info) else None


def started_pid(launcher) -> int | None:
    """The pid of an ipyparallel launcher's process once it runs, else None. Before its
    process starts a launcher says -1, which a signal would take for every process the
    caller may signal (as root: every process on the machine)."""
    pid = getattr(launcher, "pid", None)
    return pid if isinstance(pid, int) and pid > 0 else None


def resident_bytes(proc) -> int | None:
    """A rank's memory, measured here: its resident set, in bytes (None where there is no
    process, or it ended meanwhile). ``%dist_status`` and the live view both show this; a rank's
    own report (``rank/vitals.py``) measures the same, for ranks on other hosts."""
    try:
        return None if proc is None else int(proc.memory_info().rss)
    except (psutil.Error, AttributeError):  # gone, or the stand-in of a process that is gone
        return None


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


def send(proc, sig: int) -> None:
    """Signal ``proc`` (a psutil process, or None) with ``sig`` if it still runs."""
    if proc is not None and alive(proc):
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def exit_code(proc, settle: float = 1.0) -> int | None:
    """The exit code of ``proc``, a child of this process that has exited (None while it runs).

    ipyparallel's launcher waits on the same psutil process in a thread of its own. When that
    thread has reaped the child but not yet stored the code, this wait finds no child and
    psutil answers None (an mpiexec that failed at once was told without its exit code, once
    in a full run); the thread stores the code a moment later, so a None is asked again for up
    to ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        try:
            code = proc.wait(0)
        except psutil.TimeoutExpired:
            return None  # still running
        except psutil.Error:
            code = None
        if code is not None or time.monotonic() >= deadline:
            return code
        time.sleep(0.02)


def read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


#: A mapping's path in /proc/<pid>/maps, at the end of its line, when it is in /dev/shm.
_SHM_MAPPING = re.compile(r" (/dev/shm/\S+)( \(deleted\))?$", re.MULTILINE)


def shared_memory(pids: list[int]) -> set[str]:
    """The files in /dev/shm that the processes ``pids`` have mapped: their MPI's shared-memory
    segments (Open MPI's ``sm_segment.*``, MPICH's ``mpich_shm_*``, libfabric's
    ``<pid>:<n>:<n>``), made as MPI starts."""
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            found.update(path for path, deleted in _SHM_MAPPING.findall(maps.read())
                         if not deleted)
    return found



def remove_shared_memory(segments: set[str], pids: list[int]) -> None:
    """Remove the ``segments`` (:func:`shared_memory`) of ranks that have ended, and what the
    ranks ``pids`` left in /dev/shm under their pid. MPI removes them as its ranks finish, but
    a rank that was killed (a death, and the ranks its launcher then ends) leaves them: with
    Open MPI 16 MB a host per job, with MPICH 2-4 MB, and libfabric's 13 MB a rank."""
    named = {path for pid in pids for path in glob.glob(f"/dev/shm/{pid}:*")}
    for path in segments | named:
        with contextlib.suppress(OSError):
            os.unlink(path)


def heal_folders(env: dict[str, str]) -> list[str]:
    """Where a heal's shared-memory files go: the default folder, and the one the ranks'
    environment ``env`` names (``--env IPYDIST_HEAL_SHARED_MEMORY=DIR``)."""
    folders = [HEAL_SHARED_MEMORY]
    chosen = env.get(HEAL_SHARED_MEMORY_VARIABLE)
    if chosen and chosen not in ("none", HEAL_SHARED_MEMORY):
        folders.append(chosen)
    return folders


def remove_heal_files(folders: list[str], pids: list[int] | None = None) -> int:
    """Remove the shared-memory files of heals (``protocol.HEAL_FILE_PREFIX``, then the pid of
    the rank that wrote it) in ``folders`` that ranks ``pids`` wrote, or (None) this user's
    whose writer no longer runs: a rank killed in the middle of a copy leaves its file, and
    a file whose writer is gone can serve no copy. Returns how many of this user's it left
    to a writer still running (None only)."""
    left = 0
    for folder in folders:
        for path in glob.glob(os.path.join(folder, f"{HEAL_FILE_PREFIX}*")):
            match = re.match(r"(\d+)-", os.path.basename(path)[len(HEAL_FILE_PREFIX):])
            if not match:
                continue
            pid = int(match.group(1))
            if pids is not None and pid not in pids:
                continue
            with contextlib.suppress(OSError):
                if pids is None and os.stat(path).st_uid != os.getuid():
                    continue
                if pids is None and _runs(pid):
                    left += 1
                    continue
                os.unlink(path)
    return left


def _runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped by its parent, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tree(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` that still run, and every process they started that still runs
    (each once)."""
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid"]):  # one pass over /proc for every root (each
        children.setdefault(proc.info["ppid"], []).append(proc)  # .children() makes its own)
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            todo = [psutil.Process(pid)]
        except psutil.Error:
            continue
        while todo:
            proc = todo.pop()
            if proc.pid not in found:
                found[proc.pid] = proc
                todo += children.get(proc.pid, [])
    return list(found.values())


def with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process they started that still runs: the controller's schedulers
    are forked from it, and a controller SIGKILLed once its grace ran out left them running
    (issue 46)."""
    return list(dict.fromkeys([*pids, *(proc.pid for proc in tree(pids))]))


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
    """Wait until each of ``procs`` has exited (reaping those that are this process's own
    children); returns those still running. A process that exited but whose parent has not
    reaped it yet counts as gone: a rank's launcher may end first, and its orphans are then
    reaped by init, which may take a second or more (psutil.wait_procs waited for that: a
    stop spent 1.2 of its 2.4 s waiting for 4 such stubs)."""
    deadline = time.monotonic() + timeout
    still = list(procs)
    while True:
        _reap_children(still)
        still = [p for p in still if alive(p)]
        if not still or time.monotonic() >= deadline:
            return still
        time.sleep(0.02)


def _reap_children(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except OSError:  # ChildProcessError: not this process's child, or reaped already
            pass
