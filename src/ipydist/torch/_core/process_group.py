"""The default process group ipydist keeps ready: made, broken by a release, rebuilt,
abandoned.

Rank 0 serves the rendezvous store (:mod:`ipydist.torch._core.store`: a FileStore on one host,
a TCPStore across hosts, its port broadcast over MPI, so no port is ever guessed or raced for).
The same path rebuilds the group when user code destroyed it (the PyTorch DDP tutorial's
``cleanup()`` does), so ipydist's collectives keep working in the next cell.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from ipydist.torch._core import retired, store, topology
from ipydist.torch._core.topology import Runtime

#: What a collective raises on a rank a release broke (until the recovery rebuilds its group).
RELEASED_MESSAGE = ("this rank was released (a peer failed, or the cell was interrupted or "
                    "timed out): its process group is broken until the cell ends and the ranks "
                    "recover")
#: torch's own ``init_process_group``, kept before :mod:`ipydist.torch._core.shims` wraps it.
original_init_process_group = dist.init_process_group


def make(rt: Runtime, backend: str | None = None, timeout_s: float | None = None) -> None:
    """Create the default process group for ``rt`` (collective: every rank calls it).

    The first group makes the rendezvous store; later ones (a rebuild after a release, user
    code that destroyed the group and makes it again) meet in the same store under a prefix
    of their own, so no new port is opened and no old listener is left behind (a replaced
    group is kept alive: see :mod:`ipydist.torch._core.retired`). ``timeout_s`` bounds the
    rendezvous (default: the group's own timeout).
    """
    if rt.group is not None:
        retired.keep(rt.group)
    rt.backend = backend or rt.backend
    rendezvous = datetime.timedelta(seconds=timeout_s or rt.timeout_s)
    if rt.base_store is None:
        rt.base_store = store.make_store(rt, rendezvous.total_seconds())
    else:
        rt.base_store.set_timeout(rendezvous)
    rt.generation += 1
    rt.store = dist.PrefixStore(f"ipydist/group-{rt.generation}/", rt.base_store)
    topology.export_torchrun_env(rt)
    before = _connections()
    try:
        original_init_process_group(
            backend=rt.backend,
            store=rt.store,
            rank=rt.rank,
            world_size=rt.size,
            timeout=datetime.timedelta(seconds=rt.timeout_s),
        )
    finally:  # the rendezvous is over: later store waits get the usual time
        rt.base_store.set_timeout(datetime.timedelta(seconds=rt.timeout_s))
    rt.group = dist.group.WORLD
    rt.comm_sockets = [(fd, retired.inode(fd)) for fd in sorted(
        {fd for fd, local, remote in _connections() - before
         if rt.master_port not in (local[1], remote[1])})]
    rt.broken = False


def _connections() -> set[tuple]:
    """This process's connected TCP sockets, as (fd, local address, remote address): the
    group's gloo pairs are the ones its creation adds, less the rendezvous store's (listening
    sockets excluded: shutting one down kills gloo's listener). The addresses matter: a socket
    closed during the creation frees its fd number for a new pair, so fds alone would miss it."""
    import psutil

    try:
        connections = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:  # some systems need privileges to list sockets: no release by socket
        return set()
    return {(c.fd, tuple(c.laddr), tuple(c.raddr)) for c in connections
            if c.fd != -1 and c.status == psutil.CONN_ESTABLISHED}


def owns_default(rt: Runtime | None) -> bool:
    """Whether the default group is the one ipydist made (not one user code made)."""
    return (
        rt is not None and rt.group is not None and dist.is_initialized()
        and dist.group.WORLD is rt.group
    )


def break_communication() -> bool:
    """Make every pending collective of this rank fail now; True if there was a group.

    Called from the release watcher's thread while the main thread may be blocked in a
    collective: shuts down the group's gloo connections, or aborts the NCCL communicator. The
    group is then marked broken until :func:`rebuild`.
    """
    rt = topology.get()
    if rt is None or rt.group is None:
        return False
    rt.broken = True
    release = getattr(rt.group, "release", None)  # ipydist's MPI backend (--backend mpi)
    if release is not None:
        release(RELEASED_MESSAGE)
        return True
    if rt.backend == "nccl":
        try:
            rt.group._get_backend(torch.device("cuda")).abort()
        except Exception as e:
            print(f"ipydist: could not abort the NCCL communicator: {e}", file=sys.stderr)
        return True
    for fd, ino in rt.comm_sockets:
        try:
            if retired.inode(fd) == ino:  # not closed (and its number taken) meanwhile
                with socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
    return True


def rebuild(timeout_s: float | None = None) -> None:
    """Replace the default process group with a new one (collective: every rank calls it),
    its rendezvous bounded by ``timeout_s``. If that fails, the group stays broken."""
    rt = topology.get()
    if rt is None:
        return
    abandon()
    make(rt, timeout_s=timeout_s)


def abandon() -> None:
    """Drop the default group ipydist made (it stays broken until rebuilt): what a recovery
    that could not finish leaves, so that nothing it started lives on."""
    rt = topology.get()
    if rt is None:
        return
    _silence_connections(rt.comm_sockets)
    rt.broken = rt.group is not None or rt.broken
    if owns_default(rt):
        retired.keep(dist.group.WORLD)
        dist.destroy_process_group()
    rt.group, rt.store, rt.comm_sockets = None, None, []  # the base store stays


def _silence_connections(sockets: list[tuple[int, int]]) -> None:
    """Silence a replaced group's connections (see :mod:`ipydist.torch._core.retired`). gloo's loop
    may be handling one of them this moment and re-arm it: look again, a few times."""
    for _ in range(3):
        retired.silence(sockets)
        if not retired.armed(sockets):
            return
        time.sleep(0.01)


def broken_message() -> str:
    return ("this rank's process group was broken by a release (an interrupted or failed "
            "cell) and could not be rebuilt: restart the cluster (%dist_restart)")


def ensure() -> Runtime:
    """The runtime with a live default group, creating either as needed (collective)."""
    rt = topology.get()
    if rt is None:
        comm = topology.mpi_world()
        rt = topology.from_mpi(comm) if comm is not None else topology.from_env()
        rt.device_index = _default_device_index(rt)
        rt.backend = "nccl" if rt.device_index is not None else "gloo"
        topology.set_runtime(rt)
    if not dist.is_initialized():
        if rt.broken:  # a recovery gave up on it: a rebuild by one rank alone would hang
            raise RuntimeError(broken_message())
        make(rt)
    return rt


def _default_device_index(rt: Runtime) -> int | None:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = rt.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return index
    return None

