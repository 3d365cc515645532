"""Horovod's process sets: collectives among a subset of the ranks.

``ps = hvd.add_process_set([0, 2])`` (collective: every rank calls it, members or not) gives a
set that any collective takes as ``process_set=ps``; only its members call those. Sets can also
be given at ``hvd.init(process_sets=[...])`` and are removed with ``hvd.remove_process_set(ps)``.
``hvd.global_process_set`` is every rank. Ranks are always global ranks (a broadcast's root
too); ``ps.rank()`` is this rank's index within the set.

A set runs on communicators of its own, as the world does: an MPI communicator each for the
check and for the data (split from the world's when mpiexec started the ranks), and a
torch.distributed group (gloo, NCCL) for tensors that go through the process group. A
recovery after a failed or interrupted cell makes them afresh on every rank, in the order the
sets were made, since an operation it abandoned may have left them unusable.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist

from ipydist.specs import describe_ranks
from ipydist.torch._core import process_group, topology, waiting
from ipydist.torch._wire import call_check, signature


class ProcessSet:
    """A set of ranks that collectives can run among (``process_set=``), Horovod's class."""

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks = sorted({int(r) for r in ranks})
        self.process_set_id: int | None = None
        self._comms: SetComms | None = None

    def size(self) -> int | None:
        """How many ranks are in the set (None until it is added)."""
        if self.process_set_id == 0:
            return process_group.ensure().size
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This rank's index within the set, -1 if it is not in it (None until added)."""
        if self.process_set_id is None:
            return None
        me = process_group.ensure().rank
        if self.process_set_id == 0:
            return me
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self) -> bool | None:
        """Whether this rank is in the set (None until it is added)."""
        if self.process_set_id is None:
            return None
        index = self.rank()
        assert index is not None  # added: its id is set
        return index >= 0

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def __reduce__(self):
        """Unpickled as this rank's set of that id (the world's for id 0), so an object that
        names a set (a DistributedOptimizer) finds it on the rank it is copied to."""
        return _the_set, (self.process_set_id, self.ranks)


def _the_set(process_set_id: int | None, ranks: list[int]) -> ProcessSet:
    if process_set_id == 0:
        return global_process_set
    found = _sets.get(process_set_id) if process_set_id is not None else None
    return found if found is not None and found.ranks == ranks else ProcessSet(ranks)


class SetComms:
    """What a collective on a process set runs on: the same attributes as the world's
    :class:`~ipydist.torch._core.topology.Runtime` that the collectives read (size, this rank's
    index, communicators, queue of MPI operations, torch group)."""

    def __init__(self, ranks: list[int], rank: int, check_comm, data_comm, torch_group,
                 cpu_group=None) -> None:
        self.ranks, self.rank, self.size = ranks, rank, len(ranks)
        self.check_comm, self.data_comm, self.torch_group = check_comm, data_comm, torch_group
        #: A gloo group of the set for CPU tensors, when ``torch_group`` serves CUDA only.
        self.cpu_group = cpu_group
        self.data_queue: collections.deque = collections.deque()
        self.announced: collections.deque = collections.deque()  # never any: world only
        self.check_pending = False

    def index_of(self, rank: int) -> int:
        """A global rank's index within the set."""
        return self.ranks.index(rank)


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
#: The sets added and not removed, by id, in the order they were made (the same everywhere).
_sets: dict[int, ProcessSet] = {}
_next_id = 1


def comms_for(process_set: ProcessSet | None) -> SetComms | None:
    """The communicators of ``process_set`` for a collective this rank makes on it (None: the
    world's); raises ValueError if it is not usable here."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, not {process_set!r}")
    if process_set.process_set_id is None or _sets.get(process_set.process_set_id) is not \
            process_set:
        raise ValueError(f"{process_set} has not been added (hvd.add_process_set) or was "
                         "removed")
    if process_set._comms is None:
        raise ValueError(f"rank {process_group.ensure().rank} is not in {process_set}: "
                         "only its members call collectives on it")
    return process_set._comms


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Make ``process_set`` (or a set of these ranks) usable, and return it (collective: every
    rank calls it, members or not, with the same ranks)."""
    global _next_id
    rt = process_group.ensure()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = process_set.ranks
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} has been added already")
    if not ranks or ranks[0] < 0 or ranks[-1] >= rt.size:
        raise ValueError(f"a process set needs ranks among 0..{rt.size - 1}, not {ranks}")
    call_check.check("add_process_set", shape=(len(ranks),),
                    extra=signature.plan_hash(ranks))
    if any(s.ranks == ranks for s in _sets.values()) or ranks == list(range(rt.size)):
        raise ValueError(f"a process set of {describe_ranks(ranks)} exists already")
    process_set.process_set_id, _next_id = _next_id, _next_id + 1
    _sets[process_set.process_set_id] = process_set
    _connect(process_set, rt)
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget ``process_set`` on every rank (collective); False if it was not added. Its
    ``process_set_id`` becomes None."""
    process_group.ensure()
    if process_set is global_process_set:
        raise ValueError("the global process set cannot be removed")
    known = process_set.process_set_id is not None and process_set.process_set_id in _sets
    call_check.check("remove_process_set", shape=(len(process_set.ranks),),
                    extra=signature.plan_hash(process_set.ranks))
    if not known:
        return False
    set_id = process_set.process_set_id
    assert set_id is not None  # known
    del _sets[set_id]
    _disconnect(process_set, free=True)
    process_set.process_set_id = None
    return True


def add_at_init(process_sets) -> None:
    """``hvd.init(process_sets=[...])``: add each set not added yet (collective)."""
    for process_set in process_sets or ():
        if isinstance(process_set, ProcessSet) and process_set.process_set_id is not None:
            continue
        ranks = process_set.ranks if isinstance(process_set, ProcessSet) else sorted(
            {int(r) for r in process_set})
        if any(s.ranks == ranks for s in _sets.values()):
            continue  # init() again: added the first time
        add_process_set(process_set)


def any_added() -> bool:
    """Whether there are process sets besides the global one (the same answer everywhere)."""
    return bool(_sets)


def reconnect_all() -> None:
    """Make every set's communicators afresh (collective: the recovery calls it on every
    rank), in the order the sets were made."""
    rt = topology.get()
    if rt is None:
        return
    for process_set in _sets.values():
        _disconnect(process_set)
        _connect(process_set, rt)


def registry() -> tuple[list[tuple[int, list[int]]], int]:
    """The sets added, as (id, ranks) in the order they were made, and the next id: what a
    rank new to the world (a replacement, one a resize added) needs to have them too."""
    return [(set_id, s.ranks) for set_id, s in _sets.items()], _next_id


def adopt(known: tuple[list[tuple[int, list[int]]], int]) -> None:
    """On a rank new to the world, before rank 0's variables are loaded: the sets the others
    have (:func:`registry`), by the same ids, so that a copied variable that names one (a
    DistributedOptimizer's ``process_set``) is that set here. :func:`rejoin` connects them."""
    global _next_id
    sets, _next_id = known
    for set_id, ranks in sets:
        process_set = ProcessSet(ranks)
        process_set.process_set_id = set_id
        _sets[set_id] = process_set


def rejoin(size: int, gone: Iterable[int] = ()) -> list[str]:
    """After a heal or a resize, on every rank of the new world at once: the sets that name a
    rank beyond ``size`` (ranks that left) or one of ``gone`` (dead ranks the world went on
    without, the others renumbered from 0) are removed, the others are renumbered and get
    communicators in the new world (those of the old one hold ranks that are gone). Returns
    the removed sets, by their old ranks."""
    gone = sorted(set(gone))
    removed = [s for s in _sets.values()
               if s.ranks[-1] >= size + len(gone) or set(s.ranks) & set(gone)]
    for process_set in removed:
        set_id = process_set.process_set_id
        assert set_id is not None  # a set in _sets has its id
        del _sets[set_id]
        _disconnect(process_set)
        process_set.process_set_id = None
    for process_set in _sets.values():  # a rank's new number: less the gone below it
        process_set.ranks = [r - sum(g < r for g in gone) for r in process_set.ranks]
    reconnect_all()
    return [f"the process set of {describe_ranks(s.ranks)}" for s in removed]


def _connect(process_set: ProcessSet, rt: topology.Runtime) -> None:
    """Its communicators (collective over the world: non-members take part and get none)."""
    ranks = process_set.ranks
    member = rt.rank in ranks
    check_comm = data_comm = None
    if rt.control_comm is not None:
        from mpi4py import MPI

        color = 0 if member else MPI.UNDEFINED
        check_comm = rt.control_comm.Split(color, rt.rank)
        data_comm = rt.control_comm.Split(color, rt.rank)
    group = dist.new_group(ranks)  # collective over the world too
    # like the world's: gloo for CPU tensors beside a group that serves CUDA only
    cpu = None if process_group.cpu_group() is None else dist.new_group(ranks, backend="gloo")
    process_set._comms = SetComms(ranks, ranks.index(rt.rank), check_comm, data_comm,
                                  group, cpu) if member else None


def _disconnect(process_set: ProcessSet, free: bool = False) -> None:
    """Drop its communicators; ``free`` them when nothing can be pending on them (one a
    recovery replaces may have an abandoned operation: it is dropped, as the world's are)."""
    comms: Any = process_set._comms
    process_set._comms = None
    if comms is None:
        return
    waiting.park_chains(comms.data_queue)  # their memory outlives their operations
    if not free or comms.data_queue or comms.check_pending:
        return
    for comm in (comms.check_comm, comms.data_comm):
        if comm is not None:
            comm.Free()
    for group in (comms.torch_group, comms.cpu_group):
        if group is not None:
            dist.destroy_process_group(group)


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
