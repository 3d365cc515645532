"""One process per host imports torch once; the host's ranks are forked from it.

What mpiexec starts on every rank (``python -m ipydist.rank``) is then a small *stub*
(:mod:`ipydist.rank.start.stub`): it asks this host's fork server for a rank, hands over
everything it got from its launcher, and stands in for that rank towards its launcher.

Why: importing torch costs each rank about 2.7 CPU-seconds, and a host's ranks all import
it at once, so on a 2-core machine a 4-rank start spent 5 s of its 7 s importing the same
modules four times (and a shared file system serves the same files once per rank). Forked
ranks also share those modules' memory pages until they write them.

A server imports torch before anything of MPI or CUDA is touched, and is named by
:data:`~ipydist.protocol.FORKSERVER_ENV`, which the notebook sets. Two lifetimes:

- *kept*: on the notebook's own host, with Open MPI, the notebook starts the server itself
  and keeps it between its clusters (``ipydist.notebook.launch.kept_forkserver``), so that a
  restart does not import torch again (a 4-rank start 2.4 -> 1.3 s). It ends when the
  notebook's process does: it holds the read end of a pipe
  (:data:`~ipydist.protocol.FORKSERVER_OWNER_ENV`) whose write end only the notebook holds, so
  SIGKILL included.
- *per cluster*: on other hosts, with MPICH (and where the kept one is gone) the first stub
  of a cluster starts one, which ends as soon as the last rank it forked has ended, so it
  outlives no job.

Anything that goes wrong on the way (no server starts, it dies, it has a thread when it
should fork) leaves the stub to run the rank itself, as without it. ``--env
IPYDIST_FORKSERVER=0`` turns it off.

A forked rank ends when its stub is gone (a pipe whose other end only the stub holds):
mpiexec ends a rank by ending the process it started, SIGKILL included.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import weakref

from ipydist import protocol

#: Set in a rank forked by the server: the read end of the pipe its stub holds (None otherwise).
lifeline: int | None = None
#: The stub's pid in a forked rank: the process its launcher started.
stub_pid: int | None = None

#: What the server imports before it forks: the third-party modules every rank imports (its
#: own modules stay out: they may read the environment when imported, and each rank has its
#: own). In the order a rank imports them: ``tqdm.auto`` picks its bar when first imported,
#: the text bar only before ipykernel's shell is (``ipydist.rank.progress``). The kernel's
#: debugger (debugpy) and IPython's tracebacks (stack_data) are imported as the engine
#: starts: 0.1 s a rank; then what the engine's shell names by string (traitlets imports it
#: as the shell is built), its history's sqlite3 and pdb.
PRELOAD = ("tqdm.autonotebook", "torch", "torch.distributed", "torch.nn.parallel", "numpy",
           "mpi4py", "ipyparallel.engine.app", "ipykernel.ipkernel", "IPython",
           "ipykernel.debugger", "stack_data", "IPython.core.oinspect",
           "IPython.core.completerlib", "IPython.core.logger", "IPython.extensions.storemagic",
           "IPython.utils.wildcard", "sqlite3", "tornado.platform.asyncio", "pdb")
#: What a kept server (one per notebook, for all its clusters: see the module's doc) imports
#: beside :data:`PRELOAD`: what a rank's first training step imports. ``torch.optim``'s
#: ``Optimizer.zero_grad`` imports ``torch._dynamo`` on its first call (1.0-1.3 CPU-seconds),
#: which every rank of every cluster paid in its first training cell, and a hot spare at
#: idle priority while it waits. Paid once here, by the notebook's first start only; a
#: server of one cluster's own (other hosts, MPICH) leaves it to the ranks, its start being
#: on every start's path.
PRELOAD_KEPT = ("torch._dynamo",)
#: A server that no stub asked within this ends (a stub that started it and then died).
IDLE_SECONDS = 60.0
#: A rank whose stub is gone ends by itself at once (:func:`watch_stub`); one still there after
#: this long is killed by the server: its Python cannot run. Open MPI deadlocked in a TCP send
#: while marking a dead peer failed, in MPI's finalize after a heal, holding the GIL that the
#: rank's watching thread waited for; the rank and its nanny outlived their job.
STUB_GONE_GRACE_SECONDS = 3.0
_MESSAGE_MAX = 1 << 20
FDS_MAX = 250


def warm_tracebacks() -> None:
    """Format one exception as IPython does, so that its formatter's imports (pygments'
    lexers and formatters, stack_data's) are made here once, not by every rank
    (``ipydist.rank.released_errors.warm_up``, which then finds them made)."""
    try:
        from IPython.core.ultratb import VerboseTB

        try:
            raise ValueError("warming up the traceback formatter")
        except ValueError:
            VerboseTB().structured_traceback(*sys.exc_info())
    except Exception:  # only a warm-up: each rank's own then does it
        pass


def skip_torch_unregistering() -> None:
    """Leave torch's operator libraries registered at exit. torch keeps a ``weakref.finalize``
    per library (134 once torch is imported) that, run by atexit, unregisters the library's
    operators one by one: 0.04 CPU-s of each rank's end (``ipydist.rank.ending``), for
    tables inside the process that is going."""
    library = sys.modules.get("torch.library")
    unregister = getattr(library, "_del_library", None)
    if unregister is None:
        return
    for obj in gc.get_objects():
        if type(obj) is weakref.finalize:
            peeked = obj.peek()
            if peeked is not None and peeked[1] is unregister:
                obj.atexit = False


def address(key: str) -> str:
    """The server's abstract socket: one per cluster and user, and per host by nature (the
    abstract namespace belongs to a network namespace, as the test hosts are)."""
    return f"\0ipydist-forkserver-{os.getuid()}-{key}"


# --- the server --------------------------------------------------------------------------------

def serve(key: str, owner: int | None = None) -> dict | None:
    """Listen, import, fork a rank for each stub that asks; end when the last rank has ended,
    or with ``owner`` (a kept server: the read end of its owner's pipe) when that pipe closes.
    Returns only in a forked rank, with its stub's request (whose descriptors are in place)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(address(key))
    except OSError:  # another stub's server is already there
        return None
    listener.listen(128)
    for name in PRELOAD + (PRELOAD_KEPT if owner is not None else ()):
        try:
            __import__(name)
        except Exception:  # the rank imports it (and reports why it fails) itself
            pass
    warm_tracebacks()
    skip_torch_unregistering()
    # What is imported is set aside from the garbage collector (as CPython's docs advise before
    # a fork): a rank's collections then pass over its own objects only, not torch's 166,000,
    # and leave the pages it shares with this server unwritten.
    gc.freeze()
    # Forking a process with threads is unsafe, unless they expect it: OpenBLAS (numpy's) starts
    # its pool when loaded and stops it before a fork (pthread_atfork); no Python thread may run.
    if threading.active_count() != 1:
        return None
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    stubs: dict[int, socket.socket | None] = {}  # rank pid -> its stub's connection
    overdue: dict[int, float] = {}  # rank pid -> when it is killed, its stub being gone
    served = False
    started = time.monotonic()
    watched = [] if owner is None else [owner]
    while _goes_on(owner, stubs, served, started):
        connections = [c for c in stubs.values() if c is not None]
        waited_on: list[socket.socket | int] = [listener, wake_read, *watched, *connections]
        try:
            ready, _, _ = select.select(waited_on, [], [], 1.0)
        except InterruptedError:
            ready = []
        if wake_read in ready:
            os.read(wake_read, 512)
        if owner is not None and owner in ready and not os.read(owner, 1):
            return None  # the notebook's process ended; its ranks end with their stubs
        _reap(stubs)
        for pid, conn in stubs.items():
            if conn is not None and conn in ready and not conn.recv(16, socket.MSG_PEEK):
                # its stub died: its rank follows (watch_stub), and is reaped here
                conn.close()
                stubs[pid] = None
                overdue[pid] = time.monotonic() + STUB_GONE_GRACE_SECONDS
        _kill_overdue(stubs, overdue)
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
            for fd in (wake_read, wake_write, *watched):
                os.close(fd)
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


def _goes_on(owner: int | None, stubs: dict, served: bool, started: float) -> bool:
    """Whether the server serves on: a kept one until its owner's pipe closes (``serve``
    looks at it), one per cluster while it has ranks, or until IDLE_SECONDS pass unasked."""
    if owner is not None:
        return True
    return bool(stubs) if served else time.monotonic() - started < IDLE_SECONDS


def _kill_overdue(stubs: dict, overdue: dict[int, float]) -> None:
    """SIGKILL each rank that outlived its stub by :data:`STUB_GONE_GRACE_SECONDS`."""
    now = time.monotonic()
    for pid, when in list(overdue.items()):
        if pid not in stubs:  # reaped
            del overdue[pid]
        elif now >= when:
            del overdue[pid]
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _take_request(conn: socket.socket) -> dict | None:
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, _MESSAGE_MAX, FDS_MAX + 1)
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
        assert lifeline is not None  # a forked rank's: _become set it
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
    owner = os.environ.pop(protocol.FORKSERVER_OWNER_ENV, None)
    request = serve(key, None if owner is None else int(owner))
    if request is None:  # the last rank has ended: nothing to write or close, and tearing
        os._exit(0)  # down an interpreter holding torch costs about half a CPU-second
    import runpy

    # as ``python -m ipydist.rank`` would (runpy's own function for -m, not in typeshed)
    runpy._run_module_as_main(protocol.RANK_MODULE)  # type: ignore[attr-defined]


if __name__ == "__main__":  # run by its real name, so a forked rank sees what _become set
    from ipydist.rank.start import forkserver

    forkserver.main()
