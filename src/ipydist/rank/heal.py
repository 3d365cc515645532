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
(:func:`ipydist.rank.replacement.world`); both sides then make the rank's runtime and process
group in the same collective steps (:func:`ipydist.rank.bootstrap.join`). It registers with the
controller as a new engine, and the notebook copies rank 0's state to it
(:mod:`ipydist.rank.state_copy`).
"""

from __future__ import annotations

import os
import sys
import time

from ipydist import protocol
from ipydist.rank.replacement import REPLACES_OPTION


def heal(dead: list[int], replace: bool) -> dict:
    """On every survivor at once: make the world again without ``dead``, with a replacement
    for each when ``replace`` (else the survivors renumbered from 0), and this rank's runtime
    and process group in it. Returns what the notebook reports."""
    from mpi4py import MPI

    from ipydist.rank import bootstrap
    from ipydist.torch._core import process_group, resync, topology
    from ipydist.torch._wire import handles

    started = time.monotonic()
    resync.abandon_pending()
    handles.abandon_all()
    rt = topology.get()
    old_rank = rt.rank
    for comm in {id(c): c for c in (rt.comm, rt.control_comm, rt.check_comm, rt.data_comm)
                 if c is not None}.values():
        try:
            comm.Revoke()  # a survivor still waiting in one returns from it now
        except MPI.Exception:
            pass  # revoked already (by another survivor)
    survivors = rt.comm.Shrink()
    if replace and dead:
        args = ["-m", protocol.RANK_MODULE, REPLACES_OPTION + ",".join(map(str, sorted(dead))),
                *sys.argv[1:]]
        inter = survivors.Spawn(sys.executable, args=args, maxprocs=len(dead), root=0)
        merged = inter.Merge(high=False)
        world = merged.Split(0, key=old_rank)
        merged.Free()
        inter.Free()
        survivors.Free()
    else:
        world = survivors
    process_group.abandon()  # its connections to the dead are gone; the new world makes its own
    bootstrap.join(world, survivor=rt)
    return {"rank": topology.get().rank, "was": old_rank, "size": topology.get().size,
            "seconds": time.monotonic() - started, "pid": os.getpid()}
