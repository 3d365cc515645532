"""DistributedOptimizer's arguments, declared once (:class:`OptimizerOptions`), checked and
read: Horovod's names for its parameters, its fusion groups and bucket sizes, and what it
refuses, with a message that says why."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ipydist.torch._wire.compression import (
    AnyCompressor,
    Compression,
    PowerSGDCompressor,
    describe,
    is_compressor,
)
from ipydist.torch._wire.reduce_ops import Average, ReduceOp, Sum
from ipydist.torch.horovod.process_sets import ProcessSet, global_process_set

#: Default bucket size, DDP's; benchmarks/train_step.py sweeps it (see the README).
DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass(frozen=True)
class OptimizerOptions:
    """Everything ``DistributedOptimizer(optimizer, ...)`` takes after the optimizer, in
    Horovod's order (so its positional calls work): the factory's signature is checked against
    these fields by a test, and it hands them on as one object, never by position. What can
    be checked without the parameters is checked when the options are made."""

    #: ``model.named_parameters()``: names for messages (and for checking the ranks agree).
    named_parameters: Any = None
    compression: AnyCompressor = Compression.none
    backward_passes_per_step: int = 1
    op: ReduceOp = Average
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: Any = None
    sparse_as_dense: bool = False
    process_set: ProcessSet = global_process_set
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    distributed_after: int = 0

    def __post_init__(self) -> None:
        _check(self.op, self.backward_passes_per_step, self.compression,
               self.distributed_after)

    def named(self, pairs: list[tuple[str, Any]] | None) -> OptimizerOptions:
        """These options with ``named_parameters`` read once into a list (a generator, as
        ``model.named_parameters()`` is, can be read only once)."""
        return replace(self, named_parameters=pairs)

    def as_keywords(self) -> dict[str, Any]:
        """The options as ``DistributedOptimizer``'s keyword arguments (a copy's wrapping)."""
        return {option.name: getattr(self, option.name) for option in fields(self)}


def _check(op, backward_passes_per_step: int, compression, distributed_after: int) -> None:
    """Raise on arguments DistributedOptimizer cannot take."""
    if op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer op must be Average or Sum, not {op} (Adasum: "
                         "allreduce(t, op=hvd.Adasum) combines tensors; Horovod's Adasum "
                         "optimizer, which combines each step's update, is not built here)")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be at least 1")
    if compression is PowerSGDCompressor:
        raise TypeError("Compression.powersgd takes its rank: call it, e.g. "
                        "compression=hvd.Compression.powersgd(rank=4)")
    if not is_compressor(compression):
        raise TypeError("compression must be Compression.none, .fp16, .bf16, .onebit or "
                        f".powersgd(rank=...), not {compression!r}")
    if not isinstance(distributed_after, int) or distributed_after < 0:
        raise ValueError("distributed_after must be a number of steps, 0 or more")


def check_group(compression: AnyCompressor, group) -> None:
    """Raise where ``compression`` cannot work among ``group`` (a process set's
    communicators, or None for every rank): a compression's own exchange averages over
    every rank."""
    if group is not None and compression.exchange is not None:
        raise ValueError(f"{describe(compression)} averages over every rank: it takes no "
                         "process_set")


def cap_bytes(params, bucket_cap_mb: float, num_groups: int) -> float:
    """Bytes per bucket: ``bucket_cap_mb``, or the share of ``num_groups`` (Horovod's)."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be a number of groups, 0 or more, not {num_groups!r}")
    if num_groups:
        total = sum(p.numel() * p.element_size() for p in params)
        return max(total / num_groups, 1.0)
    return bucket_cap_mb * 2**20


def explicit_groups(groups, params) -> list[list]:
    """Horovod's ``groups``: lists of parameters fused together, checked."""
    if groups is None:
        return []
    if isinstance(groups, int) or not all(isinstance(g, list | tuple) for g in groups):
        raise ValueError("groups must be lists of parameters (use num_groups=n for n groups)")
    known, seen = {id(p) for p in params}, set()
    for group in groups:
        for p in group:
            if id(p) not in known:
                raise ValueError("groups hold a tensor that is not a parameter of this "
                                 "optimizer that requires a gradient")
            if id(p) in seen:
                raise ValueError("a parameter is in two of the groups")
            seen.add(id(p))
    return [list(g) for g in groups]


def names_for(params, named_parameters) -> dict[int, str]:
    if named_parameters is None:
        return {id(p): f"parameter {i}" for i, p in enumerate(params)}
    pairs = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in pairs):
        raise ValueError("named_parameters should be model.named_parameters(): (name, param) pairs")
    names = [n for n, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {', '.join(duplicates)}")
    by_id = {id(p): n for n, p in pairs}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(
            f"{len(unnamed)} of the optimizer's parameters are not in named_parameters; "
            "pass the named_parameters() of the model the optimizer was built on."
        )
    return {id(p): by_id[id(p)] for p in params}
