"""Gradients through the collectives, as Horovod defines them: the gradient of an allreduce is
the same allreduce of the gradient; of an allgather, this rank's rows of the summed gradient;
of a broadcast, the summed gradient at the root and zero elsewhere. Each backward is itself a
collective: every rank runs it, as every rank ran the forward."""

from __future__ import annotations

import torch

from ipydist.torch import runtime
from ipydist.torch.reduce_ops import Average, ReduceOp, Sum
from ipydist.torch.starts import (
    start_allgather,
    start_allreduce,
    start_alltoall,
    start_broadcast,
    start_reducescatter,
)


def _summed(grad: torch.Tensor) -> torch.Tensor:
    return start_allreduce(grad.detach().clone().contiguous(), Sum).wait()


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float):
        ctx.args = (op, prescale, postscale)
        return start_allreduce(tensor.detach().clone(), op, prescale, postscale).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        op, prescale, postscale = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"allreduce with op {op.name} has no gradient here: use "
                               "Average or Sum for tensors that require grad")
        out = start_allreduce(grad.detach().clone().contiguous(), op, prescale, postscale)
        return out.wait(), None, None, None


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor):
        pending, counts = start_allgather(tensor)
        ctx.counts, ctx.shape = counts, tensor.shape
        return pending.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rank = runtime.get().rank
        mine = _summed(grad).narrow(0, sum(ctx.counts[:rank]), ctx.counts[rank])
        return mine.reshape(ctx.shape)


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float):
        ctx.args = (op, prescale * postscale)
        return start_reducescatter(tensor, op, prescale, postscale).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        op, scale = ctx.args
        if op not in (Average, Sum):
            raise RuntimeError(f"reducescatter with op {op.name} has no gradient here: use "
                               "Average or Sum for tensors that require grad")
        whole = start_allgather(grad.contiguous())[0].wait()
        if op is Average:
            scale /= runtime.get().size
        return (whole * scale if scale != 1.0 else whole), None, None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, root_rank: int):
        ctx.root = root_rank
        return start_broadcast(tensor.detach().clone(), root_rank).wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = _summed(grad)
        if runtime.get().rank != ctx.root:
            summed.zero_()
        return summed, None


class Alltoall(torch.autograd.Function):
    """Returns the output and, not differentiable, the rows received from each rank."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, splits):
        pending, received = start_alltoall(tensor, splits)
        ctx.received, ctx.shape = received, tensor.shape
        counts = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(counts)
        return pending.wait(), counts

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _counts):
        # the gradient goes back the way the rows came, each block to the rank it came from
        back = start_alltoall(grad.contiguous(), ctx.received)[0].wait()
        if back.shape[0] < ctx.shape[0]:  # rows beyond the splits were not sent
            back = torch.cat([back, back.new_zeros((ctx.shape[0] - back.shape[0],
                                                    *back.shape[1:]))])
        return back.reshape(ctx.shape), None
