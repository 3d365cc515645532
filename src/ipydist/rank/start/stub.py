"""The stub: what mpiexec starts on every rank (``python -m ipydist.rank``) where a fork server
runs the ranks (:mod:`ipydist.rank.start.forkserver`). It asks this host's server for a rank,
hands over everything it got from its launcher (its arguments, environment, working folder and
every open file descriptor: stdout and stderr that mpiexec reads, MPICH's PMI socket), and
stands in for that rank towards its launcher: it forwards signals to it and ends as it ends (by
the same signal, or with the same code). Anything that goes wrong on the way (no server
starts, it dies) leaves the stub to run the rank itself, as without a server.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from ipydist import protocol
from ipydist.rank.start import forkserver
from ipydist.rank.start.forkserver import address

#: How long a stub waits for its rank's pid (the server may still be importing torch on a busy
#: host) before it runs the rank itself.
FORK_WAIT_SECONDS = 120.0
#: How long a new server may take to listen before the stub runs the rank itself.
LISTEN_WAIT_SECONDS = 10.0
#: How often a waiting stub looks at its launcher.
POLL_SECONDS = 0.5
#: Signals a stub passes on to its rank: how mpiexec, Slurm and people end or interrupt one.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)
_FDS_MAX = forkserver.FDS_MAX


def run_rank_there() -> None:
    """In the process mpiexec started: have this host's fork server run the rank, stand in
    for it, and exit as it exits. Returns only where the rank is to run here instead: in a
    rank forked by the server, with the server turned off, or when the server failed."""
    key = os.environ.get(protocol.FORKSERVER_ENV, "")
    if forkserver.lifeline is not None or key in ("", "0"):
        return
    try:
        conn = _connect(key)
    except OSError:
        return
    with conn:
        child = _ask(conn)
        if child is None:
            return
        _stand_in(conn, child)


def _connect(key: str) -> socket.socket:
    started = False
    deadline = time.monotonic() + LISTEN_WAIT_SECONDS
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(address(key))
            return conn
        except OSError:
            conn.close()
            if time.monotonic() > deadline:
                raise
        if not started:
            _start_server()
            started = True
        time.sleep(0.02)


def _start_server() -> None:
    """Start the server as a grandchild that no one here waits on (init reaps it), with this
    stub's environment (what mpiexec gave every rank) and none of its descriptors: mpiexec
    reads a rank's output until every holder of its pipes has closed them."""
    middle = os.fork()
    if middle == 0:
        try:
            subprocess.Popen([sys.executable, "-m", protocol.FORKSERVER_MODULE],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        finally:
            os._exit(0)
    os.waitpid(middle, 0)


def _ask(conn: socket.socket) -> int | None:
    """Send this process's whole start to the server; the forked rank's pid, or None."""
    read_end, write_end = os.pipe()  # the lifeline: only this stub holds the write end
    try:
        fds = _open_fds(exclude={conn.fileno(), read_end, write_end})
        request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
                   "stub": os.getpid(), "fds": [[fd, os.get_inheritable(fd)] for fd in fds],
                   "cores": sorted(os.sched_getaffinity(0)), "umask": _umask()}
        try:
            socket.send_fds(conn, [json.dumps(request).encode()], [*fds, read_end])
        except OSError:
            os.close(write_end)
            return None
    finally:
        os.close(read_end)
    reply = _receive(conn, FORK_WAIT_SECONDS)
    if not reply or not reply.startswith(b"pid "):
        os.close(write_end)
        return None
    return int(reply.split()[1])  # write_end stays open for this stub's life


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _open_fds(exclude: set[int]) -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in exclude:
            continue
        try:
            os.fstat(fd)  # the listing's own descriptor is closed by now
        except OSError:
            continue
        fds.append(fd)
    return sorted(fds)[:_FDS_MAX]


def _receive(conn: socket.socket, timeout: float) -> bytes | None:
    """One message from the server, waiting while this stub's launcher lives; None when the
    server is gone or the wait is over."""
    parent = os.getppid()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return None
        ready, _, _ = select.select([conn], [], [], POLL_SECONDS)
        if ready:
            try:
                return conn.recv(256) or None
            except OSError:
                return None
    return None


def _stand_in(conn: socket.socket, child: int) -> None:
    """Forward signals to the rank, and exit as it does (the server reports how)."""
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _forward(child, s))
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the launcher is gone: so is the job (the rank follows)
            os._exit(1)
        try:
            ready, _, _ = select.select([conn], [], [], POLL_SECONDS)
        except InterruptedError:
            continue
        if not ready:
            continue
        try:
            reply = conn.recv(256)
        except OSError:
            reply = b""
        if reply.startswith(b"exit "):
            _exit_as(int(reply.split()[1]))
        if not reply:  # the server died: wait for the rank by its pid
            _wait_for(child)
            os._exit(1)


def _forward(child: int, sig: int) -> None:
    try:
        os.kill(child, sig)
    except OSError:
        pass


def _wait_for(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except OSError:
            return
        time.sleep(POLL_SECONDS)


def _exit_as(status: int) -> None:
    """End this stub as the rank ended: by the same signal, or with the same code."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(1)
    sys.stdout.flush()
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
