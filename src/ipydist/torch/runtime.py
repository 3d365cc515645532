"""This rank's place in the cluster, and the default process group ipydist keeps ready.

MPI is the rendezvous: ranks learn rank, size and local rank from ``MPI.COMM_WORLD``, and
rank 0 opens a TCPStore on a free port and broadcasts the port over MPI, so no port is ever
guessed or raced for. The same path rebuilds the group when user code destroyed it (the PyTorch
DDP tutorial's ``cleanup()`` does), so ipydist's collectives keep working in the next cell.

Outside an ipydist cluster (a script under ``torchrun``) the torchrun variables are used.
"""

from __future__ import annotations

import collections
import datetime
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ipydist import protocol
from ipydist.torch import retired, store

#: This host's cores, counted once: ``os.cpu_count()`` reads /sys (17 us, on every wait).
_CORES = os.cpu_count() or 1


@dataclass
class Runtime:
    """Where this rank stands; filled once by the bootstrap or the first ``init()``."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    #: Horovod's cross rank and size: this rank's index among the ranks with its local rank
    #: (one per host, so the host's index), and how many there are.
    cross_rank: int = 0
    cross_size: int = 1
    #: Every rank on this one host: the rendezvous needs no port (see ``store.make_store``).
    one_host: bool = False
    #: Every host runs the same number of ranks (Horovod's ``is_homogeneous``).
    homogeneous: bool = True
    #: The rendezvous FileStore's file on one host (empty for a TCPStore).
    store_path: str = ""
    device_index: int | None = None
    backend: str = "gloo"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = protocol.DEFAULT_PG_TIMEOUT
    comm: Any = None  # mpi4py communicator, when launched by mpiexec
    #: The rendezvous store (a TCPStore served by rank 0), made once: every group after the
    #: first meets under a prefix of its own (see :func:`init_process_group`).
    base_store: Any = None
    #: How many groups this rank has made (the prefix of the next one's rendezvous keys).
    generation: int = 0
    #: A duplicate of ``comm`` for ipydist's own messages (recovery's votes), so they never
    #: meet user code's MPI calls.
    control_comm: Any = None
    #: Another, for the data of ipydist's collectives when they go over MPI (see
    #: :mod:`ipydist.torch.transport`), and those submitted and not finished, oldest first (a
    #: release, or an interrupted backward, can leave some behind).
    data_comm: Any = None
    data_queue: collections.deque = field(default_factory=collections.deque)
    #: Whether large reductions over MPI go in pieces (``transport.pieces``): not where ranks
    #: outnumber cores on some host, whose waits sleep between tests while a piece needs
    #: several (64 MB took 600 ms in pieces against 104 ms whole, np=4 on 2 cores). Agreed by
    #: every rank at start: ranks that cut differently would post different collectives.
    split_large: bool = True
    #: The wire of ipydist's collectives on CPU tensors: ``mpi`` or ``gloo``.
    transport: str = "gloo"
    #: Another duplicate, for the check that every rank makes the same collective call
    #: (``ipydist.torch.agreement``); replaced when a release left a check unfinished.
    check_comm: Any = None
    #: A check on ``check_comm`` began and has not finished (a release, or an interrupt, left
    #: it behind): the communicator must be replaced on every rank before the next check.
    check_pending: bool = False
    #: Checks sent ahead of their call on ``check_comm`` and not yet finished, oldest first
    #: (``agreement.announce``); like ``check_pending``, they make the recovery replace it.
    announced: collections.deque = field(default_factory=collections.deque)
    store: Any = None
    group: Any = None
    #: The group's gloo connections (what a release shuts down), as (fd, inode): gloo closes
    #: a connection it finds broken, and its fd number may then name another file.
    comm_sockets: list[tuple[int, int]] = field(default_factory=list)
    #: A release broke the group's connections: it must be rebuilt before it is used again.
    broken: bool = False

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this host than it has cores: a wait must not spin."""
        return self.local_size > _CORES

    @property
    def checks_unfinished(self) -> bool:
        """Whether ``check_comm`` holds a check not every rank may have finished (one a
        release interrupted, or one sent ahead): the recovery then replaces it."""
        return self.check_pending or bool(self.data_queue) or bool(self.announced)

    @property
    def device(self) -> torch.device:
        if self.device_index is None:
            return torch.device("cpu")
        return torch.device("cuda", self.device_index)


_runtime: Runtime | None = None
#: What a collective raises on a rank a release broke (until the recovery rebuilds its group).
RELEASED_MESSAGE = ("this rank was released (a peer failed, or the cell was interrupted or "
                    "timed out): its process group is broken until the cell ends and the ranks "
                    "recover")
_original_init_process_group = dist.init_process_group
#: Seconds this rank spent blocked in ipydist's collectives since :func:`take_waited` last ran.
_waited = 0.0


def get() -> Runtime | None:
    """The runtime if this process has one, without creating it."""
    return _runtime


def set_runtime(rt: Runtime) -> None:
    global _runtime
    _runtime = rt


def note_wait(seconds: float) -> None:
    """Count ``seconds`` spent blocked in a collective (ipydist's collectives call this)."""
    global _waited
    _waited += seconds


def take_waited() -> float:
    """The seconds counted by :func:`note_wait` since the last call (``log()`` reports them,
    so a straggler shows: the slowest rank is the one that waits least)."""
    global _waited
    waited, _waited = _waited, 0.0
    return waited


def mpi_world():
    """COMM_WORLD when this process was started by mpiexec with more than one rank, else None."""
    launched_by_mpi = any(
        k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")
    )
    if not launched_by_mpi:
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD


def topology_from_mpi(comm, advertise: str | None = None) -> Runtime:
    """rank, size, local rank and local size from MPI; master address from where rank 0 is:
    across hosts, rank 0's ``advertise`` address (the one on the network the hosts share), else
    its fully qualified name."""
    from mpi4py import MPI

    host = socket.gethostname()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_rank, local_size = local.rank, local.size
    local.Free()
    cross = comm.Split(color=local_rank, key=comm.rank)
    cross_rank, cross_size = cross.rank, cross.size
    cross.Free()
    hosts = comm.allgather(host)
    crowded_somewhere = comm.allreduce(local_size > _CORES, op=MPI.LOR)
    if len(set(hosts)) == 1:
        master_addr = "127.0.0.1"
    else:
        mine = advertise or socket.getfqdn()
        master_addr = comm.bcast(mine if comm.rank == 0 else None, root=0)
    master_addr = os.environ.get(protocol.MASTER_ADDR_ENV) or master_addr
    # MPI carries ipydist's collectives on CPU tensors unless --transport gloo said otherwise
    # (see ipydist.torch.transport): ranks that MPI started can always use it
    setting = protocol.RankConfig.from_env().transport
    return Runtime(
        transport="gloo" if setting == "gloo" else "mpi",
        rank=comm.rank, size=comm.size, local_rank=local_rank, local_size=local_size,
        cross_rank=cross_rank, cross_size=cross_size, one_host=len(set(hosts)) == 1,
        homogeneous=len(set(collections.Counter(hosts).values())) == 1,
        host=host, master_addr=master_addr,
        comm=comm, control_comm=comm.Dup(), check_comm=comm.Dup(), data_comm=comm.Dup(),
        split_large=not crowded_somewhere,
    )


def topology_from_env() -> Runtime:
    """The torchrun variables, or a world of one when there are none."""
    env = os.environ
    size = int(env.get("WORLD_SIZE", "1"))
    return Runtime(
        rank=int(env.get("RANK", "0")),
        size=size,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_size=int(env.get("LOCAL_WORLD_SIZE", str(size))),
        host=socket.gethostname(),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "0")),
    )


def export_torchrun_env(rt: Runtime) -> None:
    """Set what ``torchrun`` would set, so code written for it finds its variables."""
    os.environ.update(
        RANK=str(rt.rank),
        WORLD_SIZE=str(rt.size),
        LOCAL_RANK=str(rt.local_rank),
        LOCAL_WORLD_SIZE=str(rt.local_size),
        MASTER_ADDR=rt.master_addr,
        MASTER_PORT=str(rt.master_port),
    )


def init_process_group(rt: Runtime, backend: str | None = None,
                       timeout_s: float | None = None) -> None:
    """Create the default process group for ``rt`` (collective: every rank calls it).

    The first group makes the rendezvous store; later ones (a rebuild after a release, user
    code that destroyed the group and makes it again) meet in the same store under a prefix
    of their own, so no new port is opened and no old listener is left behind (a replaced
    group is kept alive: see :mod:`ipydist.torch.retired`). ``timeout_s`` bounds the rendezvous
    (default: the group's own timeout).
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
    export_torchrun_env(rt)
    before = _connections()
    try:
        _original_init_process_group(
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


def owns_default_group(rt: Runtime | None) -> bool:
    """Whether the default group is the one ipydist made (not one user code made)."""
    return (
        rt is not None and rt.group is not None and dist.is_initialized()
        and dist.group.WORLD is rt.group
    )


def break_communication() -> bool:
    """Make every pending collective of this rank fail now; True if there was a group.

    Called from the release watcher's thread while the main thread may be blocked in a
    collective: shuts down the group's gloo connections, or aborts the NCCL communicator. The
    group is then marked broken until :func:`rebuild_process_group`.
    """
    rt = _runtime
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


def rebuild_process_group(timeout_s: float | None = None) -> None:
    """Replace the default process group with a new one (collective: every rank calls it),
    its rendezvous bounded by ``timeout_s``. If that fails, the group stays broken."""
    if _runtime is None:
        return
    abandon_process_group()
    init_process_group(_runtime, timeout_s=timeout_s)


def abandon_process_group() -> None:
    """Drop the default group ipydist made (it stays broken until rebuilt): what a recovery
    that could not finish leaves, so that nothing it started lives on."""
    rt = _runtime
    if rt is None:
        return
    _silence_connections(rt.comm_sockets)
    rt.broken = rt.group is not None or rt.broken
    if owns_default_group(rt):
        retired.keep(dist.group.WORLD)
        dist.destroy_process_group()
    rt.group, rt.store, rt.comm_sockets = None, None, []  # the base store stays


def _silence_connections(sockets: list[tuple[int, int]]) -> None:
    """Silence a replaced group's connections (see :mod:`ipydist.torch.retired`). gloo's loop
    may be handling one of them this moment and re-arm it: look again, a few times."""
    for _ in range(3):
        retired.silence(sockets)
        if not retired.armed(sockets):
            return
        time.sleep(0.01)


def broken_message() -> str:
    return ("this rank's process group was broken by a release (an interrupted or failed "
            "cell) and could not be rebuilt: restart the cluster (%dist_restart)")


def ensure_process_group() -> Runtime:
    """The runtime with a live default group, creating either as needed (collective)."""
    global _runtime
    if _runtime is None:
        comm = mpi_world()
        _runtime = topology_from_mpi(comm) if comm is not None else topology_from_env()
        _runtime.device_index = _default_device_index(_runtime)
        _runtime.backend = "nccl" if _runtime.device_index is not None else "gloo"
    if not dist.is_initialized():
        if _runtime.broken:  # a recovery gave up on it: a rebuild by one rank alone would hang
            raise RuntimeError(broken_message())
        init_process_group(_runtime)
    return _runtime


def _default_device_index(rt: Runtime) -> int | None:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = rt.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return index
    return None
