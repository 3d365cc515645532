"""Marks on ipydist's own functions that wait for the other ranks.

A rank's stack sampler (:mod:`ipydist.rank.stack_sampler`) names the collective a rank waits in
for stall warnings and release reports. ``torch.distributed``'s functions it knows by their
module; ipydist's waits that are not one call of it (the optimizer's gradient wait, a model
average) are marked here, where they are defined, and the sampler reads the marks: the rank side
imports torch/, never the other way round.
"""

from __future__ import annotations

#: Code objects of ipydist's own functions that wait for other ranks -> what to call them.
_WAITS_FOR_PEERS: dict[object, str] = {}


def waits_for_peers(description: str):
    """Mark a function as a wait for the other ranks, shown as ``description`` in stall
    warnings and release reports (e.g. "allreduce of gradients (DistributedOptimizer)")."""
    def mark(function):
        _WAITS_FOR_PEERS[function.__code__] = description
        return function

    return mark


def marked_wait(code) -> str | None:
    """What the function of ``code`` waits for, if it is marked; else None."""
    return _WAITS_FOR_PEERS.get(code)
