"""``hvd.SyncBatchNorm``: batch normalisation whose statistics are those of the whole batch
over every rank, as if one process saw every rank's samples.

Each rank reduces its own part of the batch to a count, a mean and a sum of squared
deviations per channel, and the ranks allgather those three (one small collective per
forward, whatever the batch size) and merge them with Chan's parallel formula, which stays
accurate where ``E[x^2] - E[x]^2`` would cancel. The merge is made of differentiable torch
operations on the differentiable :func:`~ipydist.torch.allgather`, so the backward pass is
autograd's: each rank's input gradient includes what its samples did to the other ranks'
outputs through the shared statistics, and it runs the matching collective on every rank.
"""

from __future__ import annotations

import torch

from ipydist.torch.horovod.basics import size
from ipydist.torch.horovod.collectives import allgather


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
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as torch's BatchNorm does
                factor = 1.0 / float(self.num_batches_tracked)
        mean, var, count = self._global_stats(input)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach(), alpha=factor)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        out = (input - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _global_stats(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The whole batch's mean and biased variance per channel, and its sample count."""
        dims = [0] + list(range(2, input.dim()))
        local = float(input.numel() // input.shape[1])
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        if local:
            mean = x.mean(dims)
            m2 = ((x - mean.view((1, -1) + (1,) * (x.dim() - 2))) ** 2).sum(dims)
        else:  # no samples here: nothing to add (the mean of nothing is NaN)
            mean = m2 = x.sum(dims)
        counts = torch.full((1, 1), local, dtype=mean.dtype, device=mean.device)
        gathered = allgather(torch.cat([counts, mean[None], m2[None]], dim=1))
        channels = mean.numel()
        n, means = gathered[:, :1], gathered[:, 1:1 + channels]
        m2s = gathered[:, 1 + channels:]
        total = float(n.sum())
        if total <= 1:
            raise ValueError("SyncBatchNorm needs more than one value per channel over all "
                             f"ranks in training mode, got {int(total)}")
        global_mean = (n * means).sum(0) / total
        global_m2 = (m2s + n * (means - global_mean) ** 2).sum(0)
        return (global_mean.to(input.dtype), (global_m2 / total).to(input.dtype), total)

