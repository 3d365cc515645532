"""Collectives on tensors, with Horovod's names and semantics, over MPI, gloo or NCCL.

Each call makes sure the default process group exists first (user code may have destroyed it
in an earlier cell), so the API works in any cell. Tensors may live on the CPU or on the
rank's GPU: CPU tensors go over MPI when mpiexec started the ranks (``--transport``, see
:mod:`ipydist.torch.transport`), else through the process group (gloo); GPU tensors through
the process group (NCCL).

Each call first checks with the other ranks that they make the same call, with the same shape
and dtype (:mod:`ipydist.torch.agreement`), so a mismatch raises on every rank instead of
crashing one, corrupting the result or hanging. Each is marked with the torch.distributed
collective it stands for, the name stall warnings give a rank that waits in that check.
"""

from __future__ import annotations

import enum
import time

import torch
import torch.distributed as dist

from ipydist.rank.sampler import waits_for_peers
from ipydist.torch import agreement, runtime, transport, waiting


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

_MPI_OPS = {ReduceOp.Sum: "sum", ReduceOp.Average: "sum", ReduceOp.Min: "min",
            ReduceOp.Max: "max"}
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


def cross_rank() -> int:
    """This rank's index among the ranks that have its local rank: the index of its host when
    every host runs the same number of ranks (Horovod's name)."""
    return _rt().cross_rank


def cross_size() -> int:
    """How many ranks have this rank's local rank: the number of hosts, when every host runs
    the same number of ranks (Horovod's name)."""
    return _rt().cross_size


def device() -> torch.device:
    """The device this rank computes on: its pinned GPU, or the CPU."""
    return _rt().device


@waits_for_peers("barrier")
def barrier() -> None:
    """Wait until every rank gets here (the check that every rank called it is the wait)."""
    rt = _rt()
    if agreement.enabled():
        agreement.agree("barrier")
    elif rt.backend == "nccl" and rt.device_index is not None:
        dist.barrier(device_ids=[rt.device_index])
    else:
        dist.barrier()


def _check_op(op: ReduceOp) -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be one of Average, Sum, Min, Max from ipydist.torch, not {op!r}")
    return op


@waits_for_peers("all_reduce")
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
    agreement.agree("allreduce", tensor, op=op, prescale=prescale_factor,
                    postscale=postscale_factor)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    t0 = time.perf_counter()
    if transport.uses_mpi(tensor):
        transport.allreduce_(tensor, _MPI_OPS[op])
    else:
        waiting.wait_for(dist.all_reduce(tensor, op=_TORCH_OPS[op], async_op=True))
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


@waits_for_peers("all_gather")
def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match. Each rank's first
    dimension travels in the check's header, so the check costs allgather nothing.
    """
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    world = size()
    counts = agreement.agree("allgather", tensor, shape=tensor.shape[1:],
                             carried=tensor.shape[0])
    longest = max(counts)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    if transport.uses_mpi(padded):
        stacked = transport.allgather(padded, world)
        if all(n == longest for n in counts):  # already in place: no copy
            return stacked.reshape(world * longest, *padded.shape[1:])
        gathered = stacked.unbind(0)
    else:
        gathered = [torch.empty_like(padded) for _ in range(world)]
        waiting.wait_for(dist.all_gather(gathered, padded.contiguous(), async_op=True))
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])


@waits_for_peers("broadcast")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with ``root_rank``'s value, in place."""
    _check_root(root_rank)
    agreement.agree("broadcast", tensor, root=root_rank)
    if transport.uses_mpi(tensor):
        transport.broadcast_(tensor, root_rank)
    else:
        waiting.wait_for(dist.broadcast(tensor, src=root_rank, async_op=True))
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    return broadcast_(tensor.detach().clone(), root_rank, name)


def _check_root(root_rank: int) -> None:
    world = size()
    if not 0 <= int(root_rank) < world:
        raise ValueError(f"root_rank={root_rank}, but ranks are 0..{world - 1}")
