"""Collectives on tensors, with Horovod's names and semantics, on torch.distributed.

Each call makes sure the default process group exists first (user code may have destroyed it
in an earlier cell), so the API works in any cell. Tensors may live on the CPU or on the
rank's GPU; the backend ``%dist_start`` chose (gloo or NCCL) handles both.
"""

from __future__ import annotations

import enum
import time

import torch
import torch.distributed as dist

from ipydist.torch import runtime


class ReduceOp(enum.Enum):
    """Reduction applied by :func:`allreduce`."""

    Average = "average"
    Sum = "sum"
    Min = "min"
    Max = "max"


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Min = ReduceOp.Min
Max = ReduceOp.Max

_TORCH_OPS = {
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Average: dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
}


def init() -> None:
    """Make sure this rank has its process group (idempotent; collective the first time)."""
    runtime.ensure_process_group()


def _rt() -> runtime.Runtime:
    return runtime.ensure_process_group()


def rank() -> int:
    """This rank's index in the world, 0..size()-1."""
    return _rt().rank


def size() -> int:
    """Number of ranks."""
    return _rt().size


def local_rank() -> int:
    """This rank's index among the ranks on its host."""
    return _rt().local_rank


def local_size() -> int:
    """Number of ranks on this rank's host."""
    return _rt().local_size


def device() -> torch.device:
    """The device this rank computes on: its pinned GPU, or the CPU."""
    return _rt().device


def barrier() -> None:
    """Wait until every rank gets here."""
    rt = _rt()
    if rt.backend == "nccl" and rt.device_index is not None:
        dist.barrier(device_ids=[rt.device_index])
    else:
        dist.barrier()


def _check_op(op: ReduceOp) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be one of Average, Sum, Min, Max from ipydist.torch, not {op!r}")
    return op


def allreduce_(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place and return it.

    ``Average`` of an integer tensor truncates, as integer division does. ``name`` is accepted
    for Horovod compatibility; torch.distributed matches collectives by order, not by name.
    """
    op = _check_op(op)
    _rt()
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    t0 = time.perf_counter()
    dist.all_reduce(tensor, op=_TORCH_OPS[op])
    runtime.note_wait(time.perf_counter() - t0)
    if op is Average:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(size())
        else:
            tensor.copy_(torch.div(tensor, size(), rounding_mode="trunc"))
    if postscale_factor != 1.0:
        tensor.mul_(postscale_factor)
    return tensor


def allreduce(
    tensor: torch.Tensor,
    op: ReduceOp = Average,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Return ``tensor`` reduced over all ranks (a new tensor; the input is unchanged)."""
    return allreduce_(tensor.detach().clone(), op, name, prescale_factor, postscale_factor)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match.
    """
    _rt()
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    world = size()
    lengths = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    all_lengths = [torch.empty_like(lengths) for _ in range(world)]
    dist.all_gather(all_lengths, lengths)
    counts = [int(n.item()) for n in all_lengths]
    longest = max(counts)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous())
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with ``root_rank``'s value, in place."""
    _check_root(root_rank)
    dist.broadcast(tensor, src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    return broadcast_(tensor.detach().clone(), root_rank, name)


def _check_root(root_rank: int) -> None:
    world = size()
    if not 0 <= int(root_rank) < world:
        raise ValueError(f"root_rank={root_rank}, but ranks are 0..{world - 1}")
