"""The loops of 1-bit quantization, compiled by numba: one pass to sum each group, one to write
the bits and the residual, one to decode a message. The same arithmetic in torch operations
took about 17 passes over a bucket's memory (a comparison, a mask, sums, a select, a
subtraction, each its own pass), three times the time of these loops on
``benchmarks/compression.py``'s model, where the step's time is bounded by memory, not
arithmetic. That is on a CPU: on a GPU the torch operations are the path
(:mod:`ipydist.torch.training.gradients.onebit_torch`, the same messages), as they run in
GPU memory.

The format is :mod:`ipydist.torch.training.gradients.onebit`'s: value ``i`` of a message is bit
``i % 8`` of byte ``i // 8`` (set where the value is >= 0), and group ``k`` of ``group`` values
has two levels, ``levels[k, 0]`` for a 0 bit and ``levels[k, 1]`` for a 1 bit, means rounded to
bfloat16 (to nearest, ties to even). Imported on first use: numba's import is kept off the ranks'
start.
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
# The group sums may be added in any order (so that they are vectorized): a level is sent as
# the quantizing rank computed it, so the ranks agree whatever the order.
_sums = numba.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc"})


@_jit
def _round_to_bfloat16(words: np.ndarray, k: int) -> None:
    """Round float32 ``words[k]`` (seen as uint32) to bfloat16: to nearest, ties to even."""
    w = words[k]
    if (w & 0x7F800000) != 0x7F800000:  # not inf or nan
        w = w + np.uint32(0x7FFF) + ((w >> np.uint32(16)) & np.uint32(1))
    words[k] = w & np.uint32(0xFFFF0000)


@_sums
def _sums_of(grad: np.ndarray, residual: np.ndarray) -> tuple:
    """The sum, the sum of magnitudes of ``grad + residual`` (slices of one group), and how
    many of its values are >= 0."""
    total = np.float32(0.0)
    magnitude = np.float32(0.0)
    ones = np.int32(0)
    for i in range(grad.size):
        x = grad[i] + residual[i]
        total += x
        magnitude += abs(x)
        ones += np.int32(x >= 0)
    return total, magnitude, ones


@_sums
def _residual(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, signs: np.ndarray,
              lo: np.float32, hi: np.float32) -> None:
    """What one group's message does not carry into ``out``, and its values' bits into
    ``signs`` (bool, one per value: numpy packs them faster than a loop here)."""
    for i in range(grad.size):
        x = grad[i] + residual[i]  # as in the sums: the same value
        up = x >= 0
        signs[i] = up
        out[i] = x - (hi if up else lo)


@_jit
def quantize(grad: np.ndarray, residual: np.ndarray, out: np.ndarray, signs: np.ndarray,
             levels: np.ndarray, group: int) -> None:
    """The message for ``grad + residual`` (float32, n values): its bits in ``signs`` (bool,
    n; pack them with ``np.packbits``) and its ``levels`` (float32, (groups, 2)); what it does
    not carry in ``out`` (may be ``residual`` itself: each value is read before it is
    written). Each group is read while it is in the cache: its sums, then its bits and
    residual."""
    n = grad.size
    words = levels.reshape(-1).view(np.uint32)
    for k in range(levels.shape[0]):
        start, stop = k * group, min(k * group + group, n)
        g, r = grad[start:stop], residual[start:stop]
        total, magnitude, ones = _sums_of(g, r)
        zeros = (stop - start) - ones
        levels[k, 0] = (total - magnitude) / np.float32(2.0) / np.float32(max(zeros, 1))
        levels[k, 1] = (total + magnitude) / np.float32(2.0) / np.float32(max(ones, 1))
        _round_to_bfloat16(words, 2 * k)
        _round_to_bfloat16(words, 2 * k + 1)
        _residual(g, r, out[start:stop], signs[start:stop], levels[k, 0], levels[k, 1])


@_sums
def _momentum_sums(grad: np.ndarray, velocity: np.ndarray, next_velocity: np.ndarray,
                   residual: np.ndarray, out: np.ndarray, m: np.float32, damped: np.float32,
                   nesterov: bool) -> tuple:
    """Momentum correction and the sums of one group (slices): ``next_velocity = m * velocity
    + damped * grad``; the value sent is ``grad + m * next_velocity`` (Nesterov) or
    ``next_velocity``; ``out`` = that plus the residual, and its sums as ``_sums_of``'s."""
    total = np.float32(0.0)
    magnitude = np.float32(0.0)
    ones = np.int32(0)
    for i in range(grad.size):
        nv = m * velocity[i] + damped * grad[i]
        next_velocity[i] = nv
        x = (grad[i] + m * nv if nesterov else nv) + residual[i]
        out[i] = x
        total += x
        magnitude += abs(x)
        ones += np.int32(x >= 0)
    return total, magnitude, ones


@_jit
def _residual_in_place(out: np.ndarray, signs: np.ndarray, lo: np.float32,
                       hi: np.float32) -> None:
    for i in range(out.size):
        x = out[i]
        up = x >= 0
        signs[i] = up
        out[i] = x - (hi if up else lo)


@_jit
def quantize_momentum(grad: np.ndarray, velocity: np.ndarray, next_velocity: np.ndarray,
                      m: np.float32, damped: np.float32, nesterov: bool, residual: np.ndarray,
                      out: np.ndarray, signs: np.ndarray, levels: np.ndarray,
                      group: int) -> None:
    """``quantize`` of what a momentum correction sends (:mod:`momentum_correction`), with the
    new velocity written on the way: one pass over the bucket instead of two."""
    n = grad.size
    words = levels.reshape(-1).view(np.uint32)
    for k in range(levels.shape[0]):
        start, stop = k * group, min(k * group + group, n)
        o = out[start:stop]
        total, magnitude, ones = _momentum_sums(
            grad[start:stop], velocity[start:stop], next_velocity[start:stop],
            residual[start:stop], o, m, damped, nesterov)
        zeros = (stop - start) - ones
        levels[k, 0] = (total - magnitude) / np.float32(2.0) / np.float32(max(zeros, 1))
        levels[k, 1] = (total + magnitude) / np.float32(2.0) / np.float32(max(ones, 1))
        _round_to_bfloat16(words, 2 * k)
        _round_to_bfloat16(words, 2 * k + 1)
        _residual_in_place(o, signs[start:stop], levels[k, 0], levels[k, 1])


@_jit
def _decode_group(bits: np.ndarray, lo: np.float32, hi: np.float32, out: np.ndarray,
                  add: bool) -> None:
    """One group's values (``out``: its slice) from its bytes, eight at a time."""
    n = out.size
    whole = n >> 3
    for q in range(whole):
        byte = bits[q]
        for j in range(8):
            value = hi if (byte >> np.uint8(j)) & np.uint8(1) else lo
            if add:
                out[8 * q + j] += value
            else:
                out[8 * q + j] = value
    for i in range(8 * whole, n):
        value = hi if (bits[whole] >> np.uint8(i - 8 * whole)) & np.uint8(1) else lo
        if add:
            out[i] += value
        else:
            out[i] = value


@_jit
def decode(bits: np.ndarray, levels: np.ndarray, n: int, group: int, out: np.ndarray,
           add: bool) -> None:
    """The n values a message stands for, written to ``out`` or added to it (float32)."""
    for k in range(levels.shape[0]):
        start, stop = k * group, min(k * group + group, n)
        _decode_group(bits[start >> 3:], levels[k, 0], levels[k, 1], out[start:stop], add)
