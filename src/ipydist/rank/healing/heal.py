"""A world again after a rank died: the survivors keep their processes and state, and
replacements take the dead ranks' numbers (MPI's fault tolerance, ULFM, under ``--elastic``).

mpiexec started with ``--with-ft ulfm`` keeps the job when a rank dies, and the survivors
learn of the death in their MPI calls. :func:`heal` (on every survivor at once, from the
notebook) then revokes every communicator that holds the dead (so no survivor waits in one),
shrinks the world to the survivors, spawns one process per dead rank and merges them in, and
orders the merged world so that a survivor keeps its rank and a replacement takes the number
of the rank it replaces (Bland et al., "Post-failure recovery of MPI communication
capability", 2013: revoke, shrink, spawn, merge). The replacement runs ``python -m
ipydist.rank`` like any rank, and its bootstrap finds that world
(:func:`ipydist.rank.start.replacement.world`); both sides then make the rank's runtime and
process group in the same collective steps (:func:`ipydist.rank.start.bootstrap.join`). It
registers with the controller as a new engine, and the notebook copies rank 0's state to it
(:mod:`ipydist.rank.healing.state_copy`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence

from ipydist.protocol import HealReport
from ipydist.rank.healing import spares
from ipydist.rank.start import replacement


def heal(dead: list[int], replace: bool, hosts: list[str] | None = None,
         env: Sequence[str] = (), spawn: bool = True) -> HealReport:
    """On every survivor at once: make the world again without ``dead``, with a replacement
    for each when ``replace`` (else the survivors renumbered from 0): a hot spare where one
    waits (``--spares``), else a process spawned on ``hosts`` (where the dead ranks ran) when
    given and ``spawn`` allows (MPI's TCP transport is there); and this rank's runtime and
    process group in it. When a replacement cannot be had (no spare left and no spawn, or
    MPI's spawn fails, on every survivor alike), the survivors go on as the world, renumbered
    from 0, their samplers, optimizers and process sets following (``not_replaced`` says why;
    the notebook decides whether that will do). Returns what the notebook reports."""
    from mpi4py import MPI

    from ipydist.torch._core import resync, topology
    from ipydist.torch._wire import handles

    started = time.monotonic()
    resync.abandon_pending()
    handles.abandon_all()
    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    _revoke_all(rt, MPI)
    where = dict(zip(dead, hosts)) if hosts else None
    not_replaced = None
    if spares.full is not None:  # the spares take part: they were waiting for the revoke
        order = spares.Order(rt.size if replace else 0, spawn, where, env)
        group = spares.regroup(spares.shrunk(), rt.rank, order)
        world, not_replaced = group.world, group.not_replaced
        renumber = not replace or not_replaced is not None
    else:
        world = survivors = rt.comm.Shrink()
        if replace and dead and not spawn:
            not_replaced = spares.used_up(0, len(dead))
        elif replace and dead:
            try:
                world = replacement.spawned_into(survivors, sorted(dead), rt.rank, where, env)
            except MPI.Exception as e:
                not_replaced = f"MPI could not start a replacement: {e.Get_error_string()}"
        renumber = world is survivors
    out = _rejoin(world, rt, started)
    if renumber:
        out = dataclasses.replace(_renumbered(out, rt, dead), not_replaced=not_replaced)
    return out


def _revoke_all(rt, mpi) -> None:
    """Revoke every communicator this rank holds, and the spares' (so that no survivor waits
    in one, and the spares wake)."""
    for comm in (rt.comm, rt.control_comm, rt.check_comm, rt.data_comm, rt.node_data,
                 rt.cross_data, spares.full):
        if comm is None:
            continue
        try:
            comm.Revoke()  # a survivor still waiting in one returns from it now
        except mpi.Exception:
            pass  # revoked already (by another survivor)


def resize(size: int, env: Sequence[str] = (), spawn: bool = True) -> HealReport:
    """On every rank at once (``Session.scale``): a world of ``size`` ranks. Growing, the
    ranks take the spares first (``--spares``), then spawn the new ones (numbered from the
    old size up) where ``spawn`` allows; shrinking, the ranks from ``size`` up leave it, and
    end their process once they have replied."""

    from ipydist.torch._core import topology

    started = time.monotonic()
    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    if size < rt.size:
        world, left = _split_off(rt, rt.rank < size, started)
        if left is not None:
            return left
    elif spares.full is not None:
        spares.revoke()
        group = spares.regroup(spares.shrunk(), rt.rank, spares.Order(size, spawn, None, env))
        if group.not_replaced:  # a spare the notebook counted died: the world stays as it was
            return dataclasses.replace(_rejoin(group.world, rt, started),
                                       not_replaced=group.not_replaced)
        world = group.world
    else:
        world = replacement.spawned_into(rt.comm, list(range(rt.size, size)), rt.rank,
                                         None, env)
    return _rejoin(world, rt, started)


def leave(gone: list[int]) -> HealReport:
    """On every rank at once, after a heal whose replacements ``gone`` could not take rank
    0's state: they leave the world (and end their process once they replied), the others go
    on as the world, renumbered from 0, their samplers, optimizers and process sets
    following. A rank without state never takes cells."""
    from ipydist.torch._core import topology

    started = time.monotonic()
    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    world, left = _split_off(rt, rt.rank not in gone, started)
    if left is not None:
        return left
    return _renumbered(_rejoin(world, rt, started), rt, gone)


def _split_off(rt, stays: bool, started: float) -> tuple[object, HealReport | None]:
    """(the world of the ranks that stay, None) on a rank that stays (collective); on one
    that leaves, (None, its reply), its process ending once it replied."""
    from mpi4py import MPI

    from ipydist.torch._core import process_group

    world = rt.comm.Split(0 if stays else MPI.UNDEFINED, key=rt.rank)
    if stays:
        return world, None
    process_group.abandon()
    threading.Timer(LEAVE_AFTER_SECONDS, os._exit, (0,)).start()
    return None, HealReport(rank=rt.rank, left=True, seconds=time.monotonic() - started)


def _renumbered(out: HealReport, rt, gone: list[int]) -> HealReport:
    """``out`` with what followed the renumbering on a rank that stayed, ``rt`` its runtime of
    before (see :func:`ipydist.rank.healing.state_copy.renumbered`)."""
    from ipydist.rank.healing import state_copy

    followed = state_copy.renumbered(rt.rank, rt.size, sorted(gone))
    return dataclasses.replace(out, rebound=followed.rebound, sets_removed=followed.sets_removed)


def _rejoin(world, rt, started: float) -> HealReport:
    """This rank's runtime and process group in ``world`` (the old group's connections are
    dropped: some lead to ranks gone); what the notebook may show."""
    from ipydist.rank.healing import state_copy
    from ipydist.rank.start import bootstrap
    from ipydist.torch._core import process_group, topology

    process_group.abandon()
    bootstrap.join(world, survivor=rt)
    now = topology.get()
    assert now is not None  # join made it
    followed, marked = state_copy.follow_new_group()  # before rank 0's DDP models are pickled
    return HealReport(rank=now.rank, seconds=time.monotonic() - started,
                      spares=spares.spare_pids, followed=tuple(followed), marked=tuple(marked))


#: A rank that leaves the world ends its process this long after it replied.
LEAVE_AFTER_SECONDS = 0.5
