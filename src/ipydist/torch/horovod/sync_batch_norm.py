"""``hvd.SyncBatchNorm``: batch normalisation whose statistics are those of the whole batch
over every rank, as if one process saw every rank's samples.

Forward: each rank reduces its own part of the batch to a count, a mean and a sum of squared
deviations per channel; the ranks allgather those (one small collective per forward,
whatever the batch size) and merge them with Chan's parallel formula, which stays accurate
where ``E[x^2] - E[x]^2`` would cancel. Backward: each rank sums ``dy`` and ``dy * (x -
mean)`` per channel, the ranks add those up (one small allreduce), and each computes its
input's gradient, which includes what its samples did to the other ranks' outputs through the
shared statistics. Both are a :class:`torch.autograd.Function` of their own, as torch's
SyncBatchNorm is: backward keeps only the input and a few numbers per channel (autograd
through the merge kept several activation-sized temporaries, about 3x cuDNN's memory).

On a GPU the per-channel sums and the normalisation are torch's fused CUDA kernels
(``batch_norm_stats``, ``batch_norm_elemt``, ``batch_norm_backward_reduce``,
``batch_norm_backward_elemt``): statistics in float32 from a float16 or bfloat16 input, with
no float32 copy of it. Nothing waits for the device: the count travels in the gathered
tensor, the running statistics are updated with tensor operations, and the collectives are
NCCL's, ordered on the stream after the call check. A release that aborts one leaves
numbers that the optimizer's step refuses (it checks the group before it writes). On the CPU
the same arithmetic is plain torch operations, and the collectives ipydist's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ipydist.torch._wire import call_check
from ipydist.torch._wire.reduce_ops import Sum
from ipydist.torch.horovod.basics import size
from ipydist.torch.horovod.collectives import allgather, allreduce


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (input (N, C), (N, C, L), (N, C, H, W) or
    (N, C, D, H, W)) whose training statistics are reduced over every rank (collective in
    training mode: every rank runs its forward and backward). In eval mode, or with one rank,
    it is the plain batch norm on the running statistics."""

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of 2 or more dimensions (N, C, "
                             f"...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        self._check_input_dim(input)
        if not self.training or size() == 1:
            return super().forward(input)
        factor: float | torch.Tensor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as torch's BatchNorm does
                factor = 1.0 / self.num_batches_tracked  # a tensor: no wait for the device
        running = self.track_running_stats and self.running_mean is not None
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if running else None,
            self.running_var if running else None, self.eps, factor)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor):  # noqa: A002
        input = input.contiguous()
        mean, invstd, counts = _global_stats(input, eps)
        if running_mean is not None:
            with torch.no_grad():
                total = counts.sum()
                var = invstd.pow(-2) - eps
                unbiased = var * (total / (total - 1).clamp(min=1))
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype) * factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype) * factor)
        ctx.save_for_backward(input, weight, mean, invstd, counts)
        return _normalize(input, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd, counts = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        if input.is_cuda:
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
                grad_output, input, mean, invstd, weight, need_input, need_weight, need_bias)
        else:
            sum_dy, sum_dy_xmu = _plain_backward_sums(grad_output, input, mean)
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if need_weight else None
            grad_bias = sum_dy.to(weight.dtype) if need_bias else None
        grad_input = None
        if need_input:
            channels = mean.numel()
            summed = _sum_over_ranks(torch.cat([sum_dy, sum_dy_xmu]))
            sum_dy, sum_dy_xmu = summed[:channels], summed[channels:]
            if input.is_cuda:
                grad_input = torch.batch_norm_backward_elemt(
                    grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu,
                    counts.to(torch.int32))
            else:
                grad_input = _plain_grad_input(grad_output, input, weight, mean, invstd,
                                               sum_dy, sum_dy_xmu, counts.sum())
        if weight is None or not need_weight:
            grad_weight = None
        if weight is None or not need_bias:
            grad_bias = None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _global_stats(input: torch.Tensor, eps: float):
    """The whole batch's mean and inverse standard deviation per channel (float32), and every
    rank's sample count (a tensor, in rank order)."""
    channels = input.shape[1]
    local = input.numel() // channels if channels else 0
    if local > 0 and input.is_cuda:
        mean, invstd = torch.batch_norm_stats(input, eps)
        m2 = (invstd.pow(-2) - eps) * local
    elif local > 0:
        dims = [0] + list(range(2, input.dim()))
        x = input.to(_accumulated(input))  # the CPU path: transient, not kept for backward
        mean = x.mean(dims)
        m2 = (x - mean.view((1, -1) + (1,) * (x.dim() - 2))).square().sum(dims)
    else:  # no samples here: nothing to add (the mean of nothing is NaN)
        mean = m2 = torch.zeros(channels, dtype=_accumulated(input), device=input.device)
    mine = torch.cat([mean.new_full((1,), float(local)), mean, m2])[None]
    gathered = _gather(mine)
    counts, means, m2s = gathered[:, 0], gathered[:, 1:1 + channels], gathered[:, 1 + channels:]
    if local <= 1:  # only here can the whole batch be too small: a wait is fine
        total = int(counts.sum())
        if total <= 1:
            raise ValueError("SyncBatchNorm needs more than one value per channel over all "
                             f"ranks in training mode, got {total}")
    n = counts[:, None]
    total = n.sum(0)
    global_mean = (n * means).sum(0) / total
    global_m2 = (m2s + n * (means - global_mean).square()).sum(0)
    invstd = torch.rsqrt(global_m2 / total + eps)
    return global_mean, invstd, counts


def _accumulated(input: torch.Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for a float64 input."""
    return torch.promote_types(input.dtype, torch.float32)


def _gather(mine: torch.Tensor) -> torch.Tensor:
    """Every rank's row, in rank order. On a GPU over NCCL, after the call check, so the host
    does not wait for the device (ipydist's allgather would, to hand back a checked result)."""
    if not mine.is_cuda:
        return allgather(mine)
    call_check.check("allgather", mine, shape=mine.shape[1:], carried=mine.shape[0])
    out = mine.new_empty((size(), mine.shape[1]))
    dist.all_gather_into_tensor(out, mine)
    return out


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if not t.is_cuda:
        return allreduce(t, op=Sum)
    call_check.check("allreduce", t, op=Sum)
    dist.all_reduce(t)
    return t


def _normalize(input, weight, bias, mean, invstd, eps):
    if input.is_cuda:
        return torch.batch_norm_elemt(input, weight, bias, mean, invstd, eps)
    shape = (1, -1) + (1,) * (input.dim() - 2)
    out = (input.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
    if weight is not None:
        out = out * weight.to(mean.dtype).view(shape) + bias.to(mean.dtype).view(shape)
    return out.to(input.dtype)


def _plain_backward_sums(grad_output, input, mean):
    dims = [0] + list(range(2, input.dim()))
    shape = (1, -1) + (1,) * (input.dim() - 2)
    g = grad_output.to(mean.dtype)
    return g.sum(dims), (g * (input.to(mean.dtype) - mean.view(shape))).sum(dims)


def _plain_grad_input(grad_output, input, weight, mean, invstd, sum_dy, sum_dy_xmu, total):
    shape = (1, -1) + (1,) * (input.dim() - 2)
    mean_dy = (sum_dy / total).view(shape)
    mean_dy_xmu = (sum_dy_xmu / total).view(shape)
    scale = invstd if weight is None else invstd * weight.to(mean.dtype)
    xmu = input.to(mean.dtype) - mean.view(shape)
    grad = grad_output.to(mean.dtype) - mean_dy - xmu * invstd.pow(2).view(shape) * mean_dy_xmu
    return (grad * scale.view(shape)).to(input.dtype)
