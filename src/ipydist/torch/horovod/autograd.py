"""Gradients through the collectives, as current Horovod defines them (``horovod/torch/
mpi_ops.py``): the gradient of an allreduce is the same allreduce of the gradient; of an
allgather, this rank's rows of the *averaged* gradient; of a broadcast, the averaged gradient
at the root and zero elsewhere; of a reducescatter, the gathered gradient, times the number of
ranks for ``Sum`` and times the pre- and postscale factors. (Averages, not sums: when every
rank computes the same loss from the same gathered or broadcast tensor, the gradient is that
of one copy, as in a single process: Horovod averages since 0.22, #2654; ipydist summed.)
Each backward is itself a collective: every rank runs it, as every rank ran the forward."""

from __future__ import annotations

import torch

from ipydist.torch._core import topology
from ipydist.torch._wire.reduce_ops import Average, ReduceOp, Sum
from ipydist.torch._wire.starts import (
    start_allgather,
    start_allreduce,
    start_alltoall,
    start_broadcast,
    start_reducescatter,
)


def _averaged(grad: torch.Tensor, group) -> torch.Tensor:
    return start_allreduce(grad.detach().clone().contiguous(), Average, group=group).wait()


def _runtime() -> topology.Runtime:
    """This rank's runtime: there is one, the collective (forward) needed it."""
    rt = topology.get()
    assert rt is not None
    return rt


def _my_index(group) -> int:
    """This rank's index among those taking part (the world, or a process set: ``group``)."""
    return _runtime().rank if group is None else group.rank


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                group=None):
        ctx.args, ctx.group = (op, prescale, postscale), group
        return start_allreduce(tensor.detach().clone(), op, prescale, postscale,
                               group=group).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        op, prescale, postscale = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"allreduce with op {op.name} has no gradient here: use "
                               "Average or Sum for tensors that require grad")
        out = start_allreduce(grad.detach().clone().contiguous(), op, prescale, postscale,
                              group=ctx.group)
        return out.wait(), None, None, None, None


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group=None):
        pending, counts = start_allgather(tensor, group=group)
        ctx.counts, ctx.shape, ctx.group = counts, tensor.shape, group
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        me = _my_index(ctx.group)
        mine = _averaged(grad, ctx.group).narrow(0, sum(ctx.counts[:me]), ctx.counts[me])
        return mine.reshape(ctx.shape), None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float,
                group=None):
        ctx.args, ctx.group = (op, prescale * postscale), group
        return start_reducescatter(tensor, op, prescale, postscale, group=group).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        op, scale = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"reducescatter with op {op.name} has no gradient here: use "
                               "Average or Sum for tensors that require grad")
        whole = start_allgather(grad.contiguous(), group=ctx.group)[0].wait()
        if op is Sum:
            scale *= _runtime().size if ctx.group is None else ctx.group.size
        return (whole * scale if scale != 1.0 else whole), None, None, None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, root_rank: int, group=None):
        ctx.root, ctx.group = root_rank, group
        return start_broadcast(tensor.detach().clone(), root_rank, group=group).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        averaged = _averaged(grad, ctx.group)
        if _runtime().rank != ctx.root:
            averaged.zero_()
        return averaged, None, None


class Alltoall(torch.autograd.Function):
    """Returns the output and, not differentiable, the rows received from each rank."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, splits, group=None):
        pending, received = start_alltoall(tensor, splits, group=group)
        ctx.received, ctx.shape, ctx.group = received, tensor.shape, group
        counts = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(counts)
        return pending.wait(), counts

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _counts):
        # the gradient goes back the way the rows came, each block to the rank it came from
        back = start_alltoall(grad.contiguous(), ctx.received, group=ctx.group)[0].wait()
        if back.shape[0] < ctx.shape[0]:  # rows beyond the splits were not sent
            back = torch.cat([back, back.new_zeros((ctx.shape[0] - back.shape[0],
                                                    *back.shape[1:]))])
        return back.reshape(ctx.shape), None, None
