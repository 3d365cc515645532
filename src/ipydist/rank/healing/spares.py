"""Hot spares (``--spares N``): processes started with the job that take a dead rank's place
without a spawn.

mpiexec starts the ranks and N more processes; the last N of its world are the spares. Each
imports torch as a rank does (forked from the host's fork server, so its modules' pages are
shared), then waits here, asleep, out of the ranks' world: :data:`full` is the communicator of
the ranks and the spares, the ranks' world a part of it. A heal (or a grow) revokes
:data:`full`, which is how a spare learns it is needed; every process left in it then shrinks
it and :func:`regroup` deals the missing rank numbers out to the spares in order. A spare that
took a number makes its runtime and process group with the others (the same steps as a
spawned replacement, ``bootstrap.join``) and becomes an engine; the spares not needed wait
again. No spawn means no second MPI job, which on one host needs MPI's TCP transport: with
spares the ranks' MPI is shared memory only, and nothing listens beyond loopback.

When the cluster stops, rank 0 tells the spares to leave (:func:`dismiss`), so that they reach
MPI's finalize with the ranks and the job ends cleanly.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ipydist.protocol import NO_SPAWN_ON_ONE_HOST
from ipydist.rank.start import forkserver

#: The communicator of the ranks and the spares (None: no spare left, or none started).
full = None
#: The positions of the spares in :data:`full`.
_spare_positions: list[int] = []
#: The pids of the spares, in :data:`full`'s order, for the notebook (their memory).
spare_pids: tuple[int, ...] = ()

#: How long a spare sleeps between two looks at whether it is needed.
WAIT_POLL_SECONDS = 0.05
#: The tag of the message by which rank 0 tells the spares the job is over.
_LEAVE_TAG = 7031


def split_at_start(world, spares: int):
    """At the start, on every process of mpiexec's ``world`` (collective): the ranks'
    world, or None on a spare (the last ``spares`` processes)."""
    from mpi4py import MPI

    global full, _spare_positions, spare_pids
    full = world.Dup()
    size = full.Get_size()
    _spare_positions = list(range(size - spares, size))
    spare_pids = tuple(full.allgather(os.getpid())[size - spares:])
    me = full.Get_rank()
    spare = me in _spare_positions
    return full.Split(MPI.UNDEFINED if spare else 0, key=me)


@dataclass(frozen=True)
class Order:
    """What the ranks left ask of a regroup, the same on each of them."""

    #: The size of the world to make: the old one (a heal) or a bigger one (a grow).
    size: int
    #: Whether numbers no spare can take may be given to spawned processes (MPI's TCP
    #: transport is there: across hosts, or an elastic cluster without spares).
    spawn: bool
    #: Where a spawned process goes, by rank number; and the names of the environment
    #: variables it must get (see ``replacement.spawned_into``).
    hosts: dict[int, str] | None = None
    env: Sequence[str] = ()


@dataclass
class Regrouped:
    """A regroup's result on one process."""

    #: The new world (None on a spare that stays one).
    world: object
    #: Why the missing numbers were not given out (no spare and no spawn for some): the
    #: world is then the ranks left, to be renumbered.
    not_replaced: str | None = None


def regroup(shrunk, number: int | None, order: Order | None) -> Regrouped:
    """Collective over ``shrunk`` (:data:`full` shrunk to the processes alive): the ranks
    keep their ``number``; the spares (``number`` None) take the numbers missing from
    ``order.size``, in their order; numbers no spare takes are spawned when the order allows,
    else no spare is used and :attr:`Regrouped.not_replaced` says why. :data:`full` becomes
    ``shrunk`` while spares are left in it."""
    from mpi4py import MPI

    from ipydist.rank.start import replacement

    global full, _spare_positions, spare_pids
    gathered = shrunk.allgather((number, order, os.getpid()))
    order = next(o for _, o, _ in gathered if o is not None)
    present = {n for n, _, _ in gathered if n is not None}
    missing = [n for n in range(order.size) if n not in present]
    spares = [i for i, (n, _, _) in enumerate(gathered) if n is None]
    not_replaced = None
    if len(spares) < len(missing) and not order.spawn:
        not_replaced = used_up(len(spares), len(missing))
        takes: dict[int, int] = {}
    else:
        takes = dict(zip(spares, missing))
    if number is None:
        number = takes.get(shrunk.Get_rank())
    left = [i for i in spares if i not in takes]
    world = shrunk.Split(0 if number is not None else MPI.UNDEFINED,
                         key=number if number is not None else 0)
    old = full
    full, _spare_positions = (shrunk, left) if left else (None, [])
    spare_pids = tuple(gathered[i][2] for i in left)
    if old is not None:
        old.Free()
    if not left:
        shrunk.Free()
    unfilled = missing[len(takes):]
    if number is not None and unfilled and not not_replaced:
        grown = replacement.spawned_into(world, unfilled, number, order.hosts, order.env)
        world.Free()
        world = grown
    return Regrouped(world if world != MPI.COMM_NULL else None, not_replaced)


def used_up(spares: int, missing: int) -> str:
    """Why ``missing`` ranks were not replaced with only ``spares`` spares, and no spawn."""
    have = "no spare is left" if not spares else f"only {spares} spare(s) for {missing} ranks"
    return (f"{have}, and {NO_SPAWN_ON_ONE_HOST}: start with more --spares, or with "
            "--elastic")


def revoke() -> None:
    """On a rank, as a heal or a grow begins: wake the spares (they wait for this)."""
    from mpi4py import MPI

    if full is None:
        return
    try:
        full.Revoke()
    except MPI.Exception:
        pass  # revoked already, by another rank


def shrunk():
    """:data:`full` without the processes that died (collective over those alive in it)."""
    assert full is not None  # revoke() was called on a rank that has spares
    return full.Shrink()


def wait_for_turn():
    """On a spare: wait until a heal or a grow needs it, then take part in it, as often as
    it is not the one needed. Returns the world in which it has its number, or None when
    rank 0 said the job is over (the process is to end cleanly)."""
    from mpi4py import MPI

    threading.Thread(target=_warm_up, name="ipydist-spare-warm-up", daemon=True).start()
    while True:
        assert full is not None  # a spare's, from split_at_start or the last regroup
        if _wait(full, MPI):
            return None
        group = regroup(full.Shrink(), None, None)
        if group.world is not None:
            return group.world


#: What a spare imports while it waits, where its fork server did not (one of a cluster's own,
#: on another host): what a rank's first training step imports (see the kept server's
#: ``PRELOAD_KEPT``), which a replacement paid in the first step after the heal, while every
#: other rank waited for it in the step's allreduce.
WARM_UP = forkserver.PRELOAD_KEPT
def _warm_up() -> None:
    """In a thread of its own, on a spare, only when a core has nothing else to run (Linux's
    SCHED_IDLE, which it sets per thread: the spare's main thread keeps its own), so that it
    takes no core from the ranks' start: :data:`WARM_UP`."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux: at the thread's priority
        pass
    for name in WARM_UP:
        try:
            importlib.import_module(name)
        except Exception:  # the rank imports it (and says why it fails) when it needs it
            pass


def _wait(comm, mpi) -> bool:
    """Asleep between looks, until ``comm`` is revoked (False) or rank 0's leave message
    comes (True). A rank that dies is seen here first (a failed process in a probe): that
    alone says nothing, as the ranks may not heal (they wait for the notebook's word)."""
    while True:
        try:
            if comm.Iprobe(source=mpi.ANY_SOURCE, tag=_LEAVE_TAG):
                comm.recv(source=mpi.ANY_SOURCE, tag=_LEAVE_TAG)
                return True
        except mpi.Exception as e:
            if e.Get_error_class() == mpi.ERR_REVOKED:
                return False
        if comm.Is_revoked():
            return False
        time.sleep(WAIT_POLL_SECONDS)


def dismiss(rank: int) -> None:
    """On every rank as it ends cleanly: rank 0 tells the spares to leave, so that they reach
    MPI's finalize with it (Open MPI's waits for every process of the job)."""
    if full is None or rank != 0:
        return
    for position in _spare_positions:
        full.send(None, dest=position, tag=_LEAVE_TAG)
