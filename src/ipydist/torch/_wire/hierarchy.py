"""Hierarchical allreduce across hosts: the ranks of a host reduce through shared memory before
anything crosses the network (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``, NCCL's rings of
nodes).

A flat ring allreduce of n bytes among N ranks, placed host by host, sends 2 (N-1)/N x n out
of each host (its last rank's share, to the next host's first); striped, as here, a host sends
2 (H-1)/H x n with H hosts, whatever number of ranks each runs: 1.5x fewer bytes on 2 hosts of
2 ranks, nearly 2x fewer with many ranks a host. The steps:

1. ``Ireduce_scatter`` on the host's ranks (``node``): local rank j holds the host's sum of
   stripe j (1/L of the buffer), through shared memory;
2. ``Iallreduce`` of that stripe among the ranks with local rank j, one per host (``cross``):
   the L stripes cross the network at once, each rank driving its own;
3. ``Iallgatherv`` on the host's ranks: every rank has every stripe.

It needs every host to run the same number of ranks (a stripe per local rank; Horovod's
``is_homogeneous``); elsewhere the flat allreduce is used. Chosen by ``--transport``: ``auto``
takes it across hosts where it pays (``topology.hierarchical`` says where), ``hierarchical``
forces it (also on one host, where step 2 is a reduction among one), ``mpi`` never.

The communicators, ``node_data`` and ``cross_data``, are duplicates of the runtime's
``node_comm`` and ``cross_comm`` (made once, at start, by ``topology.from_mpi``), so they
never meet user code's MPI calls; a release replaces them along with the world's
``data_comm`` (``waiting.replace_check_comm``), since an operation it interrupted may still
be posted on them.
"""

from __future__ import annotations

import itertools

import numpy as np

#: Below this many bytes the flat allreduce is used: three steps' latency cost more than the
#: bytes they save (benchmarks/links.py).
HIERARCHICAL_FROM = 64 << 10


def stripes(count: int, local_size: int) -> list[int]:
    """How many of ``count`` elements each local rank reduces across hosts: as even as can be,
    the first ones one more."""
    base, extra = divmod(count, local_size)
    return [base + (1 if j < extra else 0) for j in range(local_size)]


def posts(node, cross, array: np.ndarray, op) -> list:
    """The three steps of an in-place reduction of the 1-D ``array`` by MPI ``op``, as posts for
    ``transport.Chain`` (each a function of a communicator that returns a request; the one it
    is given, ``data_comm``, is not the one they use). ``node`` and ``cross``: the runtime's
    ``node_data`` and ``cross_data``."""
    from mpi4py import MPI

    counts = stripes(array.size, node.size)
    offsets = [0, *itertools.accumulate(counts[:-1])]
    mine = np.empty(counts[node.rank], dtype=array.dtype)

    def reduce_on_host(_comm):
        return node.Ireduce_scatter(array, mine, counts, op)

    def across_hosts(_comm):
        return cross.Iallreduce(MPI.IN_PLACE, mine, op)

    def gather_on_host(_comm):
        return node.Iallgatherv(mine, [array, (counts, offsets)])

    return [reduce_on_host, across_hosts, gather_on_host]
