"""Ends a cluster whose notebook kernel is gone, however it went (SIGKILL included).

A normal stop, a kernel shutdown and a kernel restart all run ``Session.stop``; a kernel
killed outright runs nothing, and would leave the controller, mpiexec and the ranks running.
So every cluster gets a small watchdog process in its own session. It holds the read end of
a pipe whose only write end is in the kernel: when the kernel dies, the read returns at once
(no polling of the kernel's pid), and the watchdog ends every process of the cluster. While
waiting it refreshes the list of the cluster's processes (the descendants of the controller
and of mpiexec), so ranks are found even if mpiexec went first: once a second while the
cluster starts, then every few seconds (a refresh reads every process's /proc entry: 0.02
CPU-s a second of an idle cluster's, once a second on a busy machine).

    python -m ipydist.notebook.failures.watchdog FD [--heal-folder=DIR ...] PID [PID ...]
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence

from ipydist.notebook.launch import processes

#: How often the list of processes is refreshed while the cluster starts (its first
#: :data:`STARTING_SECONDS`), and after.
REFRESH_SECONDS = 1.0
STARTING_SECONDS = 15.0
LATER_REFRESH_SECONDS = 5.0
#: The option that names a folder of heal files to sweep (``--heal-folder=DIR``).
HEAL_FOLDER_OPTION = "--heal-folder="
GRACE_SECONDS = 3.0


def start(pids: list[int], heal_folders: Sequence[str] = ()) -> tuple[subprocess.Popen, int]:
    """Start a watchdog for the process trees under ``pids``; return it and the pipe's write
    end, which the caller keeps open for as long as the cluster should live. Once it ended
    them, it removes the files a heal's copy left in ``heal_folders`` (the copying rank
    killed with the kernel: see ``processes.remove_heal_files``)."""
    read_end, write_end = os.pipe()
    folders = [f"{HEAL_FOLDER_OPTION}{folder}" for folder in heal_folders]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ipydist.notebook.failures.watchdog", str(read_end), *folders,
         *map(str, pids)],
        pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )
    os.close(read_end)
    return proc, write_end


def main(argv: list[str]) -> int:
    import psutil

    fd = int(argv[0])
    folders = [a[len(HEAL_FOLDER_OPTION):] for a in argv[1:] if a.startswith(HEAL_FOLDER_OPTION)]
    roots = [int(p) for p in argv[1:] if not p.startswith(HEAL_FOLDER_OPTION)]
    known: dict[int, psutil.Process] = {}

    def refresh() -> None:
        for proc in processes.tree(roots):
            known.setdefault(proc.pid, proc)

    refresh()
    started = time.monotonic()
    while True:
        starting = time.monotonic() - started < STARTING_SECONDS
        ready, _, _ = select.select([fd], [], [],
                                    REFRESH_SECONDS if starting else LATER_REFRESH_SECONDS)
        if ready and not os.read(fd, 1):
            break  # EOF: the kernel closed the pipe or died
        refresh()
    processes.end([p for p in known.values() if p.is_running()], GRACE_SECONDS)
    # a forked rank ends with its stub, a moment after it: its file goes once it has
    deadline = time.monotonic() + GRACE_SECONDS
    while processes.remove_heal_files(folders) and time.monotonic() < deadline:
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
