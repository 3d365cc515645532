"""1-bit quantization with error feedback (Seide et al., "1-Bit Stochastic Gradient Descent and
its Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

Algorithm, for one rank's gradient ``g`` and the residual ``r`` it kept from the last step:

1. ``x = g + r`` (error feedback: what earlier steps did not send is sent now);
2. ``x`` is cut into groups of GROUP consecutive values (the paper's columns); in each group
   every value becomes one bit, set where the value is >= 0, and each bit value has one
   reconstruction value, the mean of the group's values that took it (the choice that makes
   the squared error of the group smallest);
3. the rank sends the packed bits and the two reconstruction values per group: 1 bit per value
   plus 64 bits per group, about 1/28 of the float32 gradient with GROUP = 512;
4. it keeps ``r = x - reconstruct(bits, values)``: exactly what was not sent.

Every rank reconstructs every rank's message the same way and sums them in rank order, so the
averaged gradient is bit-identical on every rank. This module is the arithmetic only (no
communication): the optimizer exchanges the messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: Values per group (the paper quantizes per column; a flat bucket has no columns, so
#: consecutive values stand in for them).
GROUP = 512


@dataclass
class Quantized:
    """One rank's message: packed bits (uint8, little-endian bit order: value ``i`` is bit
    ``i % 8`` of byte ``i // 8``) and per group the values of a 0 bit and of a 1 bit."""

    bits: np.ndarray  # uint8, ceil(numel / 8)
    levels: np.ndarray  # float32, (groups, 2): [value of a 0 bit, value of a 1 bit]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + self.levels.nbytes


def groups(numel: int) -> int:
    return -(-numel // GROUP)


def quantize(x: torch.Tensor) -> Quantized:
    """Quantize the 1-D float32 tensor ``x`` (gradient plus residual) to one bit per value."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    padded = torch.zeros(groups(n) * GROUP, dtype=torch.float32)
    padded[:n] = flat
    rows = padded.view(-1, GROUP)
    ones = rows >= 0
    real = torch.zeros_like(ones)
    real.view(-1)[:n] = True  # padding takes no part in the means
    one_count = (ones & real).sum(1)
    zero_count = (~ones & real).sum(1)
    one_sum = torch.where(ones & real, rows, 0.0).sum(1)
    zero_sum = torch.where(~ones & real, rows, 0.0).sum(1)
    levels = torch.stack([zero_sum / zero_count.clamp(min=1),
                          one_sum / one_count.clamp(min=1)], dim=1)
    bits = np.packbits(ones.view(-1)[:n].numpy(), bitorder="little")
    return Quantized(bits, levels.numpy(), n)


def dequantize(q: Quantized) -> torch.Tensor:
    """The float32 values a message stands for."""
    ones = np.unpackbits(q.bits, count=q.numel, bitorder="little").astype(bool)
    which = torch.from_numpy(ones)
    group = torch.arange(q.numel) // GROUP
    levels = torch.from_numpy(np.ascontiguousarray(q.levels))
    return levels[group, which.long()]


def quantize_with_feedback(grad: torch.Tensor, residual: torch.Tensor) -> Quantized:
    """Quantize ``grad + residual`` and leave in ``residual`` what the message does not carry
    (both 1-D float32, the same length; ``residual`` is updated in place)."""
    x = grad.detach().reshape(-1).to(torch.float32) + residual
    q = quantize(x)
    torch.sub(x, dequantize(q), out=residual)
    return q


# --- the message one rank sends: levels, then extra float32 values, then the bits ------------

def message_size(numel: int, extra: int) -> int:
    """Bytes of a message for ``numel`` values and ``extra`` float32 values sent along."""
    return groups(numel) * 8 + extra * 4 + -(-numel // 8)


def to_message(q: Quantized, extra: torch.Tensor) -> torch.Tensor:
    """``q`` and the float32 values ``extra`` (sent exactly: the optimizer's had-gradient
    flags) as one uint8 tensor, the same size on every rank for the same ``numel``."""
    return torch.from_numpy(np.concatenate([
        np.ascontiguousarray(q.levels, dtype=np.float32).reshape(-1).view(np.uint8),
        extra.detach().to(torch.float32).contiguous().numpy().view(np.uint8),
        q.bits]))


def sum_messages(rows: torch.Tensor, numel: int, extra: int) -> tuple[torch.Tensor, list]:
    """Every rank's message (``rows``: world x message bytes) reconstructed and summed in rank
    order: the values (float32) and the sums of the extra values. The same on every rank."""
    data = rows.numpy()
    level_bytes = groups(numel) * 8
    total = torch.zeros(numel, dtype=torch.float32)
    extras = np.zeros(extra, dtype=np.float64)
    for row in data:
        levels = row[:level_bytes].view(np.float32).reshape(-1, 2)
        extras += row[level_bytes:level_bytes + extra * 4].view(np.float32)
        total += dequantize(Quantized(row[level_bytes + extra * 4:], levels, numel))
    return total, extras.tolist()
