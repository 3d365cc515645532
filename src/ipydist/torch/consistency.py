"""Which tensors must be identical on every rank, and putting them back in step.

Data-parallel training keeps every rank's model identical. An interrupt or a failure can land
between one rank's optimizer step and another's, and then they differ for good. So ipydist
remembers (weakly) the tensors that are meant to be the same everywhere -- what
``broadcast_parameters`` broadcast, and the parameters and state of every
``DistributedOptimizer`` -- and after an interrupted or failed cell the notebook side calls
:func:`resync`: compare a checksum of each across ranks, and broadcast rank 0's copy of any
that differ.

What ``broadcast_parameters`` is given is usually ``model.state_dict()``, whose tensors are
fresh detached views that die with the dict, while the model lives on. So a tensor is
remembered by a weak reference to its storage (torch keeps a storage's Python object alive as
long as any tensor uses the storage) plus where it sits in it, and a view is made again when
needed: tracking lasts exactly as long as the model's memory does.
"""

from __future__ import annotations

import datetime
import gc
import sys
import weakref

import torch
import torch.distributed as dist

#: (storage pointer, offset, shape, dtype) -> (weak reference to the storage, stride)
_tensors: dict[tuple, tuple[weakref.ref, tuple[int, ...]]] = {}
_optimizers: weakref.WeakSet = weakref.WeakSet()


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def track_tensors(tensors) -> None:
    for t in tensors:
        _tensors[_key(t)] = (weakref.ref(t.untyped_storage()), tuple(t.stride()))


def _tracked_views() -> dict[tuple, torch.Tensor]:
    """A tensor for every tracked tensor whose memory still exists (forgetting the others)."""
    views = {}
    for key, (storage_ref, stride) in list(_tensors.items()):
        storage = storage_ref()
        if storage is None:
            del _tensors[key]
            continue
        _, offset, shape, dtype = key
        view = torch.empty(0, dtype=dtype, device=storage.device)
        views[key] = view.set_(storage, offset, shape, stride)
    return views


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
    seen = _tracked_views()
    for opt in list(_optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                seen.setdefault(_key(p), p.data)
                for value in opt.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor):
                        seen.setdefault(_key(value), value)
    return sorted(seen.values(), key=lambda t: (tuple(t.shape), str(t.dtype)))


def resync(root_rank: int = 0, timeout_s: float | None = None) -> int:
    """Broadcast ``root_rank``'s copy of every tracked tensor that differs between ranks
    (collective). Returns how many differed; 0 when the ranks were in step already. With
    ``timeout_s``, each collective raises after waiting that long (recovery's deadline)."""
    timeout = None if timeout_s is None else datetime.timedelta(seconds=max(timeout_s, 0.1))

    def wait(work) -> None:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)

    if not dist.is_initialized():
        return 0
    tensors = tracked()
    if not _same_everywhere(len(tensors), wait):
        # A model or optimizer the user replaced may still sit in a reference cycle (optimizer
        # hooks refer back to it), waiting for the cycle collector, which runs at a different
        # moment on each rank, or be held by the frames of the last exception a rank raised:
        # forget that and collect, so every rank tracks the same live tensors. Only then: a
        # full collection takes a second on a busy machine.
        _forget_last_exception()
        gc.collect()
        tensors = tracked()
        if not _same_everywhere(len(tensors), wait):
            raise RuntimeError("the ranks track different tensors: resynchronise by hand with "
                               "hvd.broadcast_parameters(model.state_dict(), root_rank=0)")
    if not tensors:
        return 0
    sums = torch.stack([_checksum(t) for t in tensors])
    lo, hi = sums.clone(), sums.clone()
    wait(dist.all_reduce(lo, op=dist.ReduceOp.MIN, async_op=True))
    wait(dist.all_reduce(hi, op=dist.ReduceOp.MAX, async_op=True))
    differ = [t for t, a, b in zip(tensors, lo.unbind(), hi.unbind()) if not torch.equal(a, b)]
    for t in differ:
        wait(dist.broadcast(t, src=root_rank, async_op=True))
    return len(differ)


def _forget_last_exception() -> None:
    """Drop the exception kept for ``%debug`` (``sys.last_value`` and friends, and IPython's
    traceback formatter's copy). Its frames hold the locals of the cell that raised, e.g. the
    optimizer of a model the user has replaced since; ranks that raised at different cells
    hold different ones. Nobody debugs post mortem on a rank (an engine has no terminal), and
    the error was shown."""
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    formatter = getattr(shell, "InteractiveTB", None)
    if formatter is not None and hasattr(formatter, "tb"):
        formatter.tb = None


def _same_everywhere(count: int, wait) -> bool:
    """Whether every rank has ``count`` (collective): the largest and negated smallest."""
    counts = torch.tensor([count, -count], dtype=torch.int64)
    wait(dist.all_reduce(counts, op=dist.ReduceOp.MAX, async_op=True))
    return int(counts[0]) == -int(counts[1])


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two numbers that change when any element does: the sum, and a position-weighted sum."""
    flat = t.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return torch.stack([flat.sum(), (flat * weights).sum()])
