"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021):
``hvd.allreduce(t, op=hvd.Adasum)``.

Two gradients ``a`` and ``b`` combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they are equal, so a large
batch of orthogonal directions is not slowed down and a redundant one is not overshot. The
ranks' tensors combine in a binary tree: neighbours (0, 1), (2, 3), ... first, then those
pairs' results, and so on (with a number of ranks that is not a power of two, the odd one out
moves up a level unchanged).

Where it differs from Horovod's: each rank gathers every rank's tensor and computes the
whole tree itself (the same float64 dot products and the same order everywhere, so every rank
gets the identical result), where Horovod's CPU Adasum halves the vectors between ranks to
move fewer bytes. The result is the same up to rounding; the traffic is an allgather's
(N - 1 tensors per rank), so it suits the per-tensor sizes of gradients on a few ranks, not
huge tensors on many.
"""

from __future__ import annotations

import torch


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors (any shape, the same one), with dot products in float64."""
    wide_a, wide_b = a.double(), b.double()
    dot = float((wide_a * wide_b).sum())
    norm_a, norm_b = float((wide_a * wide_a).sum()), float((wide_b * wide_b).sum())
    # a zero tensor takes no part: its coefficient does not matter, the other's becomes 1
    coeff_a = 1.0 - dot / (2.0 * norm_a) if norm_a > 0 else 1.0
    coeff_b = 1.0 - dot / (2.0 * norm_b) if norm_b > 0 else 1.0
    return (coeff_a * wide_a + coeff_b * wide_b).to(a.dtype)


def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' tensors (in rank order) combined by Adasum in a binary tree."""
    level = list(tensors)
    while len(level) > 1:
        nxt = [pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]
