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

Ranks compare tensors by name, never by position: a tensor's name is the order in which user
code tracked it (or its optimizer's, and its place there), the same on every rank. When the
ranks do not track the same tensors (memory of a replaced model that torch still holds on some
ranks only), the ones every rank has are compared, and the rest, which no live model uses, are
left alone.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import itertools
import sys
import weakref

import torch
import torch.distributed as dist

from ipydist.torch._core import process_group
from ipydist.torch._core.learner_hooks import AbandonsPending

#: (storage pointer, offset, shape, dtype) -> (weak reference to the storage, stride, serial).
#: The serial numbers tracked tensors in the order user code tracked them, which is the same
#: on every rank: it names a tensor across ranks.
_tensors: dict[tuple, tuple[weakref.ref, tuple[int, ...], int]] = {}
_serials = itertools.count()
#: Every DistributedOptimizer -> its serial (the order of creation, the same on every rank).
_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)


def track_tensors(tensors) -> None:
    for t in tensors:
        key, storage = _key(t), t.untyped_storage()
        known = _tensors.get(key)
        # the same memory tracked again keeps its serial; memory reused after a free is new
        serial = known[2] if known is not None and known[0]() is storage else next(_serials)
        _tensors[key] = (weakref.ref(storage), tuple(t.stride()), serial)


def track_optimizer(optimizer) -> None:
    if optimizer not in _optimizers:
        _optimizers[optimizer] = next(_serials)


def abandon_pending() -> None:
    """After a failed or interrupted cell: every DistributedOptimizer drops its half-done
    gradient averaging (see ``_abandon_pending``)."""
    for opt in list(_optimizers):
        if isinstance(opt, AbandonsPending):
            opt._abandon_pending()


def tracked() -> list[torch.Tensor]:
    """Every tracked tensor, once, in an order every rank agrees on."""
    return [t for _, t in _tracked_items()]


def _tracked_items() -> list[tuple[int, torch.Tensor]]:
    """(name, tensor) for every tracked tensor whose memory still exists (forgetting the
    others), sorted by name. A name is the same on every rank: the serial of a tensor
    ``broadcast_parameters`` was given, or for an optimizer's parameter or state tensor one
    made of the optimizer's serial and the tensor's place in it (with shape and dtype)."""
    items, seen = {}, set()
    for key, (storage_ref, stride, serial) in list(_tensors.items()):
        storage = storage_ref()
        if storage is None:
            del _tensors[key]
            continue
        _, offset, shape, dtype = key
        view = torch.empty(0, dtype=dtype, device=storage.device)
        items[_name(serial, shape, str(dtype))] = view.set_(storage, offset, shape, stride)
        seen.add(key)
    for opt, serial in list(_optimizers.items()):
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                places = [("param", p.data)] + [
                    (name, value) for name, value in opt.state.get(p, {}).items()
                    if isinstance(value, torch.Tensor)]
                for name, t in places:
                    if _key(t) not in seen:
                        seen.add(_key(t))
                        items[_name(serial, g, i, name, tuple(t.shape), str(t.dtype))] = t
    return sorted(items.items(), key=lambda item: item[0])


def _name(*place) -> int:
    """A 62-bit name for a tensor's place (its serial, or its optimizer's and its place
    there), with its shape and dtype: ranks whose serials went apart (an optimizer made on
    some ranks only) then share no name between tensors of different shapes, which one
    broadcast between them would abort the process on."""
    digest = hashlib.blake2b(repr(place).encode(), digest_size=7).digest()
    return (1 << 61) | int.from_bytes(digest, "little")


def from_root(root_rank: int = 0, timeout_s: float | None = None) -> int:
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
    cpu = process_group.cpu_group()  # the checksums and names are CPU tensors
    items = _tracked_items()
    if not _same_everywhere([name for name, _ in items], wait, cpu):
        # A model or optimizer the user replaced may still sit in a reference cycle (optimizer
        # hooks refer back to it), waiting for the cycle collector, which runs at a different
        # moment on each rank, or be held by the frames of the last exception a rank raised:
        # forget that and collect. Memory torch itself still holds on some ranks (a collective
        # a release abandoned) can outlive that; it belongs to no live model, so only the
        # tensors every rank still has are compared. Only then: a full collection takes a
        # second on a busy machine.
        _forget_last_exception()
        gc.collect()
        items = _tracked_items()
        common = _common(items, wait, cpu)
        items = [(name, t) for name, t in items if name in common]
    if not items:
        return 0
    sums = torch.stack([_checksum(t) for _, t in items])
    lo, hi = sums.clone(), sums.clone()
    wait(dist.all_reduce(lo, op=dist.ReduceOp.MIN, async_op=True, group=cpu))
    wait(dist.all_reduce(hi, op=dist.ReduceOp.MAX, async_op=True, group=cpu))
    differ = [t for (_, t), a, b in zip(items, lo.unbind(), hi.unbind()) if not torch.equal(a, b)]
    for t in differ:  # each over the group that serves its device
        wait(dist.broadcast(t, src=root_rank, async_op=True,
                            group=cpu if t.device.type == "cpu" else None))
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


def _same_everywhere(names: list[int], wait, cpu) -> bool:
    """Whether every rank tracks the same names (collective): their count and a digest of
    them, largest and negated smallest."""
    digest = int.from_bytes(hashlib.blake2b(repr(names).encode(), digest_size=7).digest(),
                            "little")
    words = torch.tensor([len(names), digest, -len(names), -digest], dtype=torch.int64)
    wait(dist.all_reduce(words, op=dist.ReduceOp.MAX, async_op=True, group=cpu))
    return int(words[0]) == -int(words[2]) and int(words[1]) == -int(words[3])


def _common(items: list[tuple[int, torch.Tensor]], wait, cpu) -> set[int]:
    """The names every rank tracks (collective: an all-gather of each rank's names)."""
    names = torch.tensor([name for name, _ in items], dtype=torch.int64)
    longest = torch.tensor([len(names)], dtype=torch.int64)
    wait(dist.all_reduce(longest, op=dist.ReduceOp.MAX, async_op=True, group=cpu))
    padded = torch.full((int(longest),), -1, dtype=torch.int64)
    padded[:len(names)] = names
    gathered = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(gathered, padded, async_op=True, group=cpu))
    sets = [set(g.tolist()) - {-1} for g in gathered]
    return set.intersection(*sets)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two numbers that change when any element does: the sum, and a position-weighted sum."""
    flat = t.detach().reshape(-1).to("cpu", torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    return torch.stack([flat.sum(), (flat * weights).sum()])
