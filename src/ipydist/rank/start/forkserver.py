"""One process per host imports torch once; the host's ranks are forked from it.

What mpiexec starts on every rank (``python -m ipydist.rank``) is then a small *stub*: it asks
this host's fork server for a rank, hands over everything it got from its launcher (its
arguments, environment, working folder and every open file descriptor: stdout and stderr
that mpiexec reads, MPICH's PMI socket), and stands in for that rank towards its launcher:
it forwards signals to it and ends as it ends (by the same signal, or with the same code).

Why: importing torch costs each rank about 2.7 CPU-seconds, and a host's ranks all import
it at once, so on a 2-core machine a 4-rank start spent 5 s of its 7 s importing the same
modules four times (and a shared file system serves the same files once per rank). Forked
ranks also share those modules' memory pages until they write them.

The server is started by the first stub of a cluster on a host (one per cluster, named by
:data:`~ipydist.protocol.FORKSERVER_ENV`, which the notebook sets), imports torch before
anything of MPI or CUDA is touched, and ends as soon as the last rank it forked has ended, so
it outlives no job. Anything that goes wrong on the way (no server starts, it dies, it has
a thread when it should fork) leaves the stub to run the rank itself, as without it.
``--env IPYDIST_FORKSERVER=0`` turns it off.

A forked rank ends when its stub is gone (a pipe whose other end only the stub holds):
mpiexec ends a rank by ending the process it started, SIGKILL included.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from ipydist import protocol

#: Set in a rank forked by the server: the read end of the pipe its stub holds (None otherwise).
lifeline: int | None = None
#: The stub's pid in a forked rank: the process its launcher started.
stub_pid: int | None = None

#: What the server imports before it forks: the third-party modules every rank imports (its
#: own modules stay out: they may read the environment when imported, and each rank has its
#: own). In the order a rank imports them: ``tqdm.auto`` picks its bar when first imported,
#: the text bar only before ipykernel's shell is (``ipydist.rank.progress``). The kernel's
#: debugger (debugpy) and IPython's tracebacks (stack_data) are imported as the engine starts:
#: 0.1 s a rank.
PRELOAD = ("tqdm.autonotebook", "torch", "torch.distributed", "torch.nn.parallel", "numpy",
           "mpi4py", "ipyparallel.engine.app", "ipykernel.ipkernel", "IPython",
           "ipykernel.debugger", "stack_data")
#: How long a stub waits for its rank's pid (the server may still be importing torch on a busy
#: host) before it runs the rank itself.
FORK_WAIT_SECONDS = 120.0
#: How long a new server may take to listen before the stub runs the rank itself.
LISTEN_WAIT_SECONDS = 10.0
#: A server that no stub asked within this ends (a stub that started it and then died).
IDLE_SECONDS = 60.0
#: How often a waiting stub looks at its launcher.
POLL_SECONDS = 0.5
#: Signals a stub passes on to its rank: how mpiexec, Slurm and people end or interrupt one.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)
_MESSAGE_MAX = 1 << 20
_FDS_MAX = 250


def address(key: str) -> str:
    """The server's abstract socket: one per cluster and user, and per host by nature (the
    abstract namespace belongs to a network namespace, as the test hosts are)."""
    return f"\0ipydist-forkserver-{os.getuid()}-{key}"


# --- the stub: what mpiexec started ------------------------------------------------------------

def run_rank_there() -> None:
    """In the process mpiexec started: have this host's fork server run the rank, stand in
    for it, and exit as it exits. Returns only where the rank is to run here instead: in a
    rank forked by the server, with the server turned off, or when the server failed."""
    key = os.environ.get(protocol.FORKSERVER_ENV, "")
    if lifeline is not None or key in ("", "0"):
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
            subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             close_fds=True, start_new_session=True)
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


# --- the server --------------------------------------------------------------------------------

def serve(key: str) -> dict | None:
    """Listen, import, fork a rank for each stub that asks; end when the last rank has ended.
    Returns only in a forked rank, with its stub's request (whose descriptors are in place)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(address(key))
    except OSError:  # another stub's server is already there
        return None
    listener.listen(128)
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # the rank imports it (and reports why it fails) itself
            pass
    # Forking a process with threads is unsafe, unless they expect it: OpenBLAS (numpy's) starts
    # its pool when loaded and stops it before a fork (pthread_atfork); no Python thread may run.
    if threading.active_count() != 1:
        return None
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stubs: dict[int, socket.socket | None] = {}  # rank pid -> its stub's connection
    served = False
    started = time.monotonic()
    while stubs if served else time.monotonic() - started < IDLE_SECONDS:
        connections = [c for c in stubs.values() if c is not None]
        try:
            ready, _, _ = select.select([listener, wake_read, *connections], [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_read in ready:
            os.read(wake_read, 512)
        _reap(stubs)
        for pid, conn in stubs.items():
            if conn in ready and not conn.recv(16, socket.MSG_PEEK):  # its stub died: its
                conn.close()  # rank follows (watch_stub), and is reaped here
                stubs[pid] = None
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        request = _take_request(conn)
        if request is None:
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for other in (listener, conn, *connections):
                other.close()
            os.close(wake_read)
            os.close(wake_write)
            return _become(request)
        for fd in request["received"]:
            os.close(fd)
        served = True
        stubs[pid] = conn
        try:
            conn.send(f"pid {pid}".encode())
        except OSError:
            conn.close()
            stubs[pid] = None
    return None


def _take_request(conn: socket.socket) -> dict | None:
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, _MESSAGE_MAX, _FDS_MAX + 1)
        request = json.loads(data)
    except (OSError, ValueError):
        return None
    if len(fds) != len(request.get("fds", [])) + 1:
        for fd in fds:
            os.close(fd)
        return None
    request["received"] = fds
    return request


def _reap(stubs: dict[int, socket.socket | None]) -> None:
    while stubs:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = stubs.pop(pid, None)
        if conn is not None:
            try:
                conn.send(f"exit {status}".encode())
            except OSError:
                pass
            conn.close()


def _become(request: dict) -> dict:
    """In the forked child: take the stub's descriptors, environment, folder and arguments."""
    global lifeline, stub_pid
    received = request["received"]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in received]  # clear of the targets
    for fd in received:
        os.close(fd)
    for (target, inheritable), fd in zip(request["fds"], high):
        os.dup2(fd, target, inheritable=inheritable)
        os.close(fd)
    lifeline, stub_pid = high[-1], request["stub"]
    os.set_inheritable(lifeline, False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    # The cores mpiexec bound the stub to (Open MPI binds each of 2 ranks to a core of its
    # own), not the first stub's, which the server inherited.
    os.sched_setaffinity(0, request["cores"])
    sys.argv[:] = request["argv"]
    if "numpy.random" in sys.modules:  # imported here: each rank draws its own seed, as fresh
        sys.modules["numpy.random"].seed()
    return request


def watch_stub(report) -> None:
    """In a forked rank: end it as soon as its stub is gone (its launcher ended it); ``report``
    says so first."""
    def watch():
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))
        while True:
            try:
                if not os.read(lifeline, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        report(stub_pid)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="ipydist-stub-watch").start()


def main() -> None:
    key = os.environ.get(protocol.FORKSERVER_ENV, "")
    if not key:
        sys.exit("ipydist.rank.start.forkserver: started without IPYDIST_FORKSERVER")
    request = serve(key)
    if request is None:  # the last rank has ended: nothing to write or close, and tearing
        os._exit(0)  # down an interpreter holding torch costs about half a CPU-second
    import runpy

    runpy._run_module_as_main(protocol.RANK_MODULE)  # as ``python -m ipydist.rank`` would


if __name__ == "__main__":  # run by its real name, so a forked rank sees what _become set
    from ipydist.rank.start import forkserver

    forkserver.main()
