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

from ipydist.torch._core import gpu_sharing, retired, store, topology
from ipydist.torch._core.topology import Runtime

#: What a collective raises on a rank a release broke (until the recovery rebuilds its group).
RELEASED_MESSAGE = ("this rank was released (a peer failed, or the cell was interrupted or "
                    "timed out): its process group is broken until the cell ends and the ranks "
                    "recover")
#: torch's own ``init_process_group``, kept before :mod:`ipydist.torch._core.shims` wraps it.
original_init_process_group = dist.init_process_group
#: What ipydist asks torch for when the backend is NCCL: NCCL for CUDA tensors and gloo for
#: CPU ones (torch's own default when no backend is named). NCCL alone serves CUDA tensors
#: only, and ipydist's recovery, object collectives and checks move CPU tensors.
NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"


def torch_backend(name: str) -> str:
    """The backend string given to torch for ipydist's backend ``name``."""
    return NCCL_WITH_CPU if name == "nccl" else name


def nccl_serves_cuda() -> bool:
    """Whether the default group's CUDA tensors travel over NCCL (``nccl``, or a user's
    ``cuda:nccl``/``cpu:gloo,cuda:nccl``)."""
    rt = topology.get()
    return rt is not None and "nccl" in rt.backend


def keep_nccl_errors_in_the_rank() -> None:
    """Set NCCL's watchdog to abort the communicators on an error or a timeout and let the
    operations raise (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, "CleanUpOnly"), never to end
    the process (torch's default, 3, tears the rank down, and with it mpiexec's whole job
    and every rank's state). ipydist's release and recovery then stay in charge: an
    operation the watchdog ended raises in the cell like one a release ended, and the
    recovery rebuilds the group. A value the user set is kept."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


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
    name = backend or rt.backend
    rendezvous = datetime.timedelta(seconds=timeout_s or rt.timeout_s)
    if rt.base_store is None:
        rt.base_store = store.make_store(rt, rendezvous.total_seconds())
    else:
        rt.base_store.set_timeout(rendezvous)
    rt.generation += 1
    rt.store = dist.PrefixStore(f"ipydist/group-{rt.generation}/", rt.base_store)
    topology.export_torchrun_env(rt)
    backend = torch_backend(name)
    if "nccl" in backend:
        keep_nccl_errors_in_the_rank()
    # With the device named, NCCL connects now, at start, where a failure is reported as
    # one, rather than in the first collective of some later cell.
    device_id = (torch.device("cuda", rt.device_index)
                 if "nccl" in backend and rt.device_index is not None else None)
    before = connections()
    try:
        original_init_process_group(
            backend=backend,
            store=rt.store,
            rank=rt.rank,
            world_size=rt.size,
            timeout=datetime.timedelta(seconds=rt.timeout_s),
            device_id=device_id,
        )
        rt.cpu_group = _cpu_group_beside(dist.group.WORLD)
    finally:  # the rendezvous is over: later store waits get the usual time
        rt.base_store.set_timeout(datetime.timedelta(seconds=rt.timeout_s))
    rt.backend = name  # only now: a backend torch refused leaves the cluster's own
    _took_over(rt, before)


def adopt(rt: Runtime, before: set[tuple]) -> None:
    """Take the default group user code just made for ipydist's own world (its ranks, with
    an ``init_method`` or ``store`` of its own) as ipydist's (collective): a release then
    breaks it like one ipydist made, and the recovery rebuilds it, with the same backend,
    through ipydist's rendezvous (the user's may not be usable twice: a ``file://`` store
    its first group removed, a ``tcp://`` port still taken). ``before``: :func:`connections`
    before it was made."""
    if rt.group is not None and rt.group is not dist.group.WORLD:
        retired.keep(rt.group)
    rt.backend = dist.get_backend_config()
    rt.cpu_group = _cpu_group_beside(dist.group.WORLD)
    _took_over(rt, before)


def _took_over(rt: Runtime, before: set[tuple]) -> None:
    """The new default group is ipydist's: remember it and its gloo connections."""
    rt.group = dist.group.WORLD
    rt.comm_sockets = [(fd, retired.inode(fd)) for fd in sorted(
        {fd for fd, local, remote in connections() - before
         if rt.master_port not in (local[1], remote[1])})]
    rt.broken = False


def collective_count(rt: Runtime) -> int:
    """How many collectives ipydist's groups have run on this rank (-1 when unknown or
    broken): each backend's count, NCCL's and gloo's of a mixed group and the side group's,
    since the group's own count is one backend's."""
    if rt.group is None or rt.broken:
        return -1
    backends = {}
    for group in (rt.group, rt.cpu_group):
        for device in ("cpu", "cuda"):
            try:
                backend = group._get_backend(torch.device(device))
            except Exception:  # none for this device, or no group (the side group)
                continue
            backends[id(backend)] = backend
    try:
        if not backends:  # ipydist's MPI backend: a ProcessGroup of its own
            return int(rt.group._get_sequence_number_for_group())
        return sum(int(b._get_sequence_number_for_group()) for b in backends.values())
    except Exception:
        return -1


def serves_cpu(group) -> bool:
    """Whether ``group`` has a backend for CPU tensors (a group of NCCL alone has not)."""
    if getattr(group, "release", None) is not None:  # ipydist's MPI backend: CPU tensors
        return True
    try:
        group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return False
    return True


def _cpu_group_beside(group):
    """None when ``group`` serves CPU tensors, else a gloo group of the same ranks, made now
    (collective), for them."""
    if serves_cpu(group):
        return None
    return dist.new_group(backend="gloo")


def connections() -> set[tuple]:
    """This process's connected TCP sockets, as (fd, local address, remote address): the
    group's gloo pairs are the ones its creation adds, less the rendezvous store's (listening
    sockets excluded: shutting one down kills gloo's listener). The addresses matter: a socket
    closed during the creation frees its fd number for a new pair, so fds alone would miss it."""
    import psutil

    try:
        found = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:  # some systems need privileges to list sockets: no release by socket
        return set()
    return {(c.fd, tuple(c.laddr), tuple(c.raddr)) for c in found
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
    _abort_nccl()
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
    if dist.is_initialized():  # a default group user code made for a world of its own
        retired.keep(dist.group.WORLD)
        dist.destroy_process_group()
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
    rt.group, rt.cpu_group, rt.store, rt.comm_sockets = None, None, None, []  # base store stays


def _silence_connections(sockets: list[tuple[int, int | None]]) -> None:
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
    """The runtime with a live default group, creating either as needed (collective). Outside
    a cluster of ipydist's (a script under plain mpiexec or torchrun), ranks that share a GPU
    share it as a cluster's do (:mod:`~ipydist.torch._core.gpu_sharing`)."""
    rt = topology.get()
    if rt is None:
        comm = topology.mpi_world()
        rt = topology.from_mpi(comm) if comm is not None else topology.from_env()
        rt.device_index = _default_device_index(rt)
        if rt.device_index is not None:
            rt.gpu_sharing, env = gpu_sharing.plan_sharing(
                rt.local_size, torch.cuda.device_count(), "auto", False, nccl_version(),
                rt.host, rt.local_rank)
            os.environ.update(env)
        rt.backend = gpu_sharing.resolve_backend("auto", rt.device_index, rt.gpu_sharing)
        topology.set_runtime(rt)
    if not dist.is_initialized():
        if rt.broken:  # a recovery gave up on it: a rebuild by one rank alone would hang
            raise RuntimeError(broken_message())
        make(rt)
    return rt


def nccl_version() -> tuple[int, ...] | int | None:
    """NCCL's version as this torch reports it; None for a torch built without NCCL."""
    try:
        return torch.cuda.nccl.version()
    except Exception:
        return None


def _default_device_index(rt: Runtime) -> int | None:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = rt.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return index
    return None




def cpu_group():
    """The group to pass as ``group=`` for a torch.distributed collective on CPU tensors over
    every rank: None (the default group) when the default group serves the ``cpu`` device
    type, else the gloo group kept beside it (see :func:`make`)."""
    rt = topology.get()
    return None if rt is None else rt.cpu_group


def nccl_backends() -> list:
    """The NCCL backend of every process group this process has (the default group's,
    process sets', groups users made with ``new_group``)."""
    from torch.distributed import distributed_c10d

    found = []
    for group in list(getattr(distributed_c10d._world, "pg_names", {})):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:
            continue
        if type(backend).__name__ == "ProcessGroupNCCL":
            found.append(backend)
    return found


def _abort_nccl() -> None:
    """Abort the NCCL communicators of every group, so that whatever waits on any of them
    ends: a rank stuck after a process set's collective, or the rebuild's
    ``destroy_process_group()`` behind an unmatched operation, is released too. Aborted
    together (one NCCL group call), as torch's ``_abort_process_group`` does: aborting one
    communicator may wait for a kernel that waits for another."""
    backends = nccl_backends()
    if not backends:
        return
    try:
        backends[0]._group_start()
        try:
            for backend in backends:
                backend.abort()
        finally:
            backends[0]._group_end()
    except Exception as e:
        print(f"ipydist: could not abort the NCCL communicators: {e}", file=sys.stderr)
