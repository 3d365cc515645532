"""Which tensors must be identical on every rank, and putting them back in step.

Data-parallel training keeps every rank's model identical. An interrupt or a failure can land
between one rank's optimizer step and another's, and then they differ for good. So ipydist
remembers (weakly) the tensors that are meant to be the same everywhere -- what
``broadcast_parameters`` broadcast, and the parameters and state of every
``DistributedOptimizer`` -- and after an interrupted or failed cell the notebook side calls
:func:`resync`: compare a checksum of each across ranks, and broadcast rank 0's copy of any
that differ.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist

_tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_optimizers: weakref.WeakSet = weakref.WeakSet()


def track_tensors(tensors) -> None:
    for t in tensors:
        _tensors[id(t)] = t


def track_optimizer(optimizer) -> None:
    _optimizers.add(optimizer)


def abandon_pending() -> None:
    """After a failed or interrupted cell: every DistributedOptimizer drops its half-done
    gradient averaging (see ``_abandon_pending``)."""
    for opt in list(_optimizers):
        abandon = getattr(opt, "_abandon_pending", None)
        if abandon is not None:
            abandon()


def tracked() -> list[torch.Tensor]:
    """Every tracked tensor, once, in an order every rank agrees on (creation order is not
    guaranteed the same, so tensors are sorted by shape and dtype, then by their order here)."""
    seen: dict[int, torch.Tensor] = dict(_tensors.items())
    for opt in list(_optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
                for value in opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        seen.setdefault(id(value), value)
    tensors = [t.data if isinstance(t, torch.nn.Parameter) else t for t in seen.values()]
    return sorted(tensors, key=lambda t: (tuple(t.shape), str(t.dtype)))


def resync(root_rank: int = 0) -> int:
    """Broadcast ``root_rank``'s copy of every tracked tensor that differs between ranks
    (collective). Returns how many differed; 0 when the ranks were in step already."""
    if not dist.is_initialized():
        return 0
    # A model or optimizer the user replaced may still sit in a reference cycle (optimizer
    # hooks refer back to it), waiting for the cycle collector, which runs at a different
    # moment on each rank: collect now, so every rank tracks the same live tensors.
    gc.collect()
    tensors = tracked()
    # the largest and (negated) smallest count, so every rank reaches the same verdict
    counts = torch.tensor([len(tensors), -len(tensors)], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if int(counts[0]) != -int(counts[1]):
        raise RuntimeError("the ranks track different tensors: resynchronise by hand with "
                           "hvd.broadcast_parameters(model.state_dict(), root_rank=0)")
    if not tensors:
        return 0
    sums = torch.stack([_checksum(t) for t in tensors])
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    differ = [t for t, a, b in zip(tensors, lo.unbind(), hi.unbind()) if not torch.equal(a, b)]
    for t in differ:
        dist.broadcast(t, src=root_rank)
    return len(differ)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two numbers that change when any element does: the sum, and a position-weighted sum."""
    flat = t.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return torch.stack([flat.sum(), (flat * weights).sum()])
