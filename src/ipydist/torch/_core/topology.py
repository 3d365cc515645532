"""This rank's place in the cluster: rank, size, local and cross ranks, host, device, and the
communicators and settings ipydist's collectives use (:class:`Runtime`).

MPI is the rendezvous: ranks learn rank, size and local rank from ``MPI.COMM_WORLD``. Outside an
ipydist cluster (a script under ``torchrun``) the torchrun variables are used. The default
process group that goes with it is :mod:`ipydist.torch._core.process_group`'s.
"""

from __future__ import annotations

import collections
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from ipydist import protocol

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
    #: How CUDA tensors travel when this host's ranks share its GPUs (a word of
    #: ``gpu_sharing.SHARING_WAYS``); "" when each rank has a GPU of its own.
    gpu_sharing: str = ""
    backend: str = "gloo"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = protocol.DEFAULT_PG_TIMEOUT
    comm: Any = None  # mpi4py communicator, when launched by mpiexec
    #: The rendezvous store (a FileStore on one host, a TCPStore served by rank 0 across
    #: hosts), made once: every group after the first meets under a prefix of its own (see
    #: :func:`ipydist.torch._core.process_group.make`).
    base_store: Any = None
    #: How many groups this rank has made (the prefix of the next one's rendezvous keys).
    generation: int = 0
    #: A duplicate of ``comm`` for ipydist's own messages (recovery's votes), so they never
    #: meet user code's MPI calls.
    control_comm: Any = None
    #: Another, for the data of ipydist's collectives when they go over MPI (see
    #: :mod:`ipydist.torch._wire.transport`), and those submitted and not finished, oldest first (a
    #: release, or an interrupted backward, can leave some behind).
    data_comm: Any = None
    data_queue: collections.deque = field(default_factory=collections.deque)
    #: This host's ranks, and the ranks with this rank's local rank (one per host): what the
    #: hierarchical allreduce's communicators are duplicated from (``_wire.hierarchy``).
    node_comm: Any = None
    cross_comm: Any = None
    #: Those duplicates, where the ranks take the hierarchical allreduce; else None.
    node_data: Any = None
    cross_data: Any = None
    #: Whether large reductions over MPI go in pieces (``transport.pieces``): not where ranks
    #: outnumber cores on some host, whose waits sleep between tests while a piece needs
    #: several (64 MB took 600 ms in pieces against 104 ms whole, np=4 on 2 cores). Agreed by
    #: every rank at start: ranks that cut differently would post different collectives.
    split_large: bool = True
    #: The wire of ipydist's collectives on CPU tensors: ``mpi`` (flat, or hierarchical where
    #: ``node_data`` is set) or ``gloo``.
    transport: str = "gloo"
    #: Another duplicate, for the check that every rank makes the same collective call
    #: (``ipydist.torch._wire.call_check``); replaced when a release left a check unfinished.
    check_comm: Any = None
    #: A check on ``check_comm`` began and has not finished (a release, or an interrupt, left
    #: it behind): the communicator must be replaced on every rank before the next check.
    check_pending: bool = False
    #: Checks sent ahead of their call on ``check_comm`` and not yet finished, oldest first
    #: (``call_check.announce``); like ``check_pending``, they make the recovery replace it.
    announced: collections.deque = field(default_factory=collections.deque)
    store: Any = None
    group: Any = None
    #: A gloo group of every rank beside a default group that serves CUDA tensors only (NCCL
    #: alone, or a user's ``cuda:...`` backend): what ipydist's collectives on CPU tensors
    #: use then (``process_group.cpu_group``). None when the default group serves CPU.
    cpu_group: Any = None
    #: The group's gloo connections (what a release shuts down), as (fd, inode): gloo closes
    #: a connection it finds broken, and its fd number may then name another file (inode
    #: None: closed already when the group was made).
    comm_sockets: list[tuple[int, int | None]] = field(default_factory=list)
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


def get() -> Runtime | None:
    """The runtime if this process has one, without creating it."""
    return _runtime


def set_runtime(rt: Runtime) -> None:
    global _runtime
    _runtime = rt


def mpi_world():
    """COMM_WORLD when this process was started by mpiexec with more than one rank, else None."""
    launched_by_mpi = any(
        k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")
    )
    if not launched_by_mpi:
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD


def from_mpi(comm, advertise: str | None = None) -> Runtime:
    """rank, size, local rank and local size from MPI; master address from where rank 0 is:
    across hosts, rank 0's ``advertise`` address (the one on the network the hosts share), else
    its fully qualified name."""
    from mpi4py import MPI

    host = socket.gethostname()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_rank, local_size = local.rank, local.size
    cross = comm.Split(color=local_rank, key=comm.rank)
    cross_rank, cross_size = cross.rank, cross.size
    # One exchange for all a rank learns of the others. Across hosts, an object allreduce
    # with an op here was seen stalled for 20 s and more, holding the GIL (py-spy), while the
    # engine missed its heartbeats (issue 46). Rank 0's address is the one taken.
    everyone = comm.allgather((host, local_size > _CORES, advertise if comm.rank == 0 else None))
    hosts = [h for h, _, _ in everyone]
    homogeneous = len(set(collections.Counter(hosts).values())) == 1
    crowded_somewhere = any(crowded for _, crowded, _ in everyone)
    if len(set(hosts)) == 1:
        master_addr = "127.0.0.1"
    elif not (master_addr := everyone[0][2]):  # no route found: rank 0's name, as it knows it
        master_addr = comm.bcast(socket.getfqdn() if comm.rank == 0 else None, root=0)
    master_addr = os.environ.get(protocol.MASTER_ADDR_ENV) or master_addr
    # MPI carries ipydist's collectives on CPU tensors unless --transport gloo said otherwise
    # (see ipydist.torch._wire.transport): ranks that MPI started can always use it
    setting = protocol.RankConfig.from_env().transport
    horovods = os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE")  # Horovod's switch, as it says
    if setting == "auto" and horovods in ("0", "1"):
        setting = "hierarchical" if horovods == "1" else "mpi"
    blocks = sum(1 for i, h in enumerate(hosts) if i == 0 or hosts[i - 1] != h)
    striped = hierarchical(setting, len(set(hosts)), homogeneous, local_size,
                           consecutive=blocks == len(set(hosts)))
    return Runtime(
        transport="gloo" if setting == "gloo" else "mpi",
        rank=comm.rank, size=comm.size, local_rank=local_rank, local_size=local_size,
        cross_rank=cross_rank, cross_size=cross_size, one_host=len(set(hosts)) == 1,
        homogeneous=homogeneous, host=host, master_addr=master_addr,
        comm=comm, control_comm=comm.Dup(), check_comm=comm.Dup(), data_comm=comm.Dup(),
        node_comm=local, cross_comm=cross, node_data=local.Dup() if striped else None,
        cross_data=cross.Dup() if striped else None, split_large=not crowded_somewhere,
    )


def hierarchical(setting: str, hosts: int, homogeneous: bool, local_size: int,
                 consecutive: bool) -> bool:
    """Whether the ranks take the hierarchical allreduce (``_wire.hierarchy``): each decides
    from what every rank knows alike (the ``--transport`` setting, where the ranks are).

    ``hierarchical`` forces it, also on one host (where the reduction across hosts is among
    one rank). ``auto`` takes it where ranks span hosts, each host runs more than one, and a
    host's ranks are not consecutive (``--map-by node``): there Open MPI's flat allreduce,
    whose large exchanges are between near ranks first, crosses the network with twice a
    hierarchy's bytes. Where they are consecutive it keeps those exchanges within hosts and is
    as fast or faster (benchmarks/links.py, 1 Gbit/s links, 64 MB: 2 hosts x 2 ranks by slot
    572 ms flat, 594 ms hierarchical, by node 1156 against 629; 3 hosts x 2 by slot 1176
    against 1672, by node 2621 against 1683)."""
    if not homogeneous:
        return False  # a stripe per local rank: every host needs as many
    if setting == "hierarchical":
        return True
    return setting == "auto" and hosts > 1 and local_size > 1 and not consecutive


def from_env() -> Runtime:
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
