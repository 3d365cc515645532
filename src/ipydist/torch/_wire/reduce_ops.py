"""The reductions of :func:`ipydist.torch.allreduce`, with Horovod's names, and how each maps to
MPI and to torch.distributed."""

from __future__ import annotations

import enum
import warnings

import torch.distributed as dist


class ReduceOp(enum.Enum):
    """Reduction applied by :func:`allreduce`."""

    Average = "average"
    Sum = "sum"
    Min = "min"
    Max = "max"
    Product = "product"
    Adasum = "adasum"


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
Adasum = ReduceOp.Adasum

MPI_OPS = {Sum: "sum", Average: "sum", Min: "min", Max: "max", Product: "prod"}
TORCH_OPS = {
    Sum: dist.ReduceOp.SUM,
    Average: dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}


def resolve(average: bool | ReduceOp | None, op: ReduceOp | None) -> ReduceOp:
    """The reduction from Horovod's arguments: ``op`` (default Average), or the deprecated
    ``average`` (True: Average, False: Sum), never both. An op passed where ``average`` stands
    (the second positional argument, ipydist's own order before) is taken as the op."""
    if isinstance(average, ReduceOp):
        average, op = None, average if op is None else op
    if average is not None:
        if op is not None:
            raise ValueError("pass op= or the deprecated average=, not both")
        warnings.warn("average= is deprecated (as in Horovod): use op=hvd.Average or "
                      "op=hvd.Sum", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"op must be one of Average, Sum, Min, Max, Product, Adasum from ipydist.torch, "
            f"not {op!r}")
    return op
