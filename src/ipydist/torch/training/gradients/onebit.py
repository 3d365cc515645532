"""1-bit quantization with error feedback (Seide et al., "1-Bit Stochastic Gradient Descent and
its Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

Algorithm, for one rank's gradient ``g`` and the residual ``r`` it kept from the last step:

1. ``x = g + r`` (error feedback: what earlier steps did not send is sent now);
2. ``x`` is cut into groups of GROUP consecutive values (the paper's columns); in each group
   every value becomes one bit, set where the value is >= 0, and each bit value has one
   reconstruction value, the mean of the group's values that took it (the
   choice that makes the squared error of the group smallest), rounded to bfloat16;
3. the rank sends the packed bits and the two reconstruction values per group: 1 bit per value
   plus 32 bits per group, 1.5 bits per value with GROUP = 64, 1/21 of float32;
4. it keeps ``r = x - reconstruct(bits, values)``: exactly what was not sent.

The loops are compiled (:mod:`ipydist.torch.training.gradients.onebit_kernels`) for buckets on the
CPU; a bucket on a GPU is quantized there by the same arithmetic in torch operations
(:mod:`ipydist.torch.training.gradients.onebit_torch`), into the same messages. This module is the
format, the stripes and their bookkeeping.

Why groups of 64 with bfloat16 levels (measured by ``benchmarks/onebit_accuracy.py``, a
one-process emulation of this exchange on 4 ranks, digits MLP and CNN, SGD with momentum 0.9
at full precision's learning rate, 30 epochs, mean of 4 seeds; full precision 0.969 and
0.981): the coarser the groups, the further the reconstruction of a group's small values is from
them, and the larger the residual that momentum then amplifies. Even with momentum before the
quantizer (:mod:`ipydist.torch.training.gradients.momentum_correction`), groups of 512 (1.06 bits
per value, as built first) trained the MLP to 0.23 and the CNN to 0.91, groups of 128 to 0.92 and
0.981, groups of 64 to 0.974 and 0.982. bfloat16 levels keep float32's range (no overflow for
large gradients, no flush to zero for small ones), and their rounding goes to the residual.

The ranks exchange the messages by stripes, as CNTK does (see ``stripes`` below): each rank
owns a stripe, sums the ranks' messages for it in rank order and quantizes the sum again with
a residual of its own, and every rank decodes every owner's message. So the averaged gradient
is bit-identical on every rank, and each rank sends about 1/21 of a float32 allreduce's bytes
whatever the number of ranks. This module is the arithmetic only (no communication):
:mod:`ipydist.torch.training.gradients.onebit_exchange` moves the messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: Values per group (the paper quantizes per column; a flat bucket has no columns, so
#: consecutive values stand in for them). Chosen by measurement: see the module docstring.
GROUP = 64
#: Bytes of one group's two reconstruction values (bfloat16 each).
LEVEL_BYTES = 4


@dataclass
class QuantizedArrays:
    """One rank's message: packed bits (uint8, little-endian bit order: value ``i`` is bit
    ``i % 8`` of byte ``i // 8``) and per group the values of a 0 bit and of a 1 bit (float32
    arrays holding bfloat16 values, sent as their 16 high bits)."""

    bits: np.ndarray  # uint8, ceil(numel / 8)
    levels: np.ndarray  # float32, (groups, 2): [value of a 0 bit, value of a 1 bit]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + self.levels.shape[0] * LEVEL_BYTES


def groups(numel: int) -> int:
    return -(-numel // GROUP)


def _kernels():
    """The compiled loops (:mod:`ipydist.torch.training.gradients.onebit_kernels`), imported on
    first use."""
    from ipydist.torch.training.gradients import onebit_kernels

    return onebit_kernels


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A float32 CPU tensor's memory as numpy (written through)."""
    return t.detach().numpy()


def quantize_with_feedback(grad: torch.Tensor, residual: torch.Tensor,
                           out: torch.Tensor | None = None,
                           momentum: Momentum | None = None) -> QuantizedArrays:
    """Quantize ``grad + residual`` and write what the message does not carry into ``out``
    (``residual`` itself when not given; all 1-D float32 of one length). The optimizer passes
    a second buffer, so that a step abandoned before its exchange leaves the residual as the
    last completed step left it. With ``momentum`` (slices of this length), what is quantized
    is the momentum correction's value for ``grad`` and its new velocity is written on the
    way."""
    grad = grad.detach().reshape(-1).to(torch.float32).contiguous()
    out = residual if out is None else out
    n = grad.numel()
    signs = _signs(n)
    levels = np.empty((groups(n), 2), dtype=np.float32)
    if momentum is None:
        _kernels().quantize(_numpy(grad), _numpy(residual), _numpy(out), signs, levels, GROUP)
    else:
        _kernels().quantize_momentum(
            _numpy(grad), _numpy(momentum.velocity), _numpy(momentum.next_velocity),
            np.float32(momentum.m), np.float32(momentum.damped), momentum.nesterov,
            _numpy(residual), _numpy(out), signs, levels, GROUP)
    return QuantizedArrays(np.packbits(signs, bitorder="little"), levels, n)


@dataclass
class Momentum:
    """SGD's momentum kept before the quantizer
    (:mod:`ipydist.torch.training.gradients.momentum_correction`), for
    ``quantize_with_feedback`` to apply on the way: the velocity, where the new one goes,
    momentum, ``1 - dampening`` and Nesterov."""

    velocity: torch.Tensor
    next_velocity: torch.Tensor
    m: float
    damped: float
    nesterov: bool

    def __getitem__(self, part: slice) -> Momentum:
        return Momentum(self.velocity[part], self.next_velocity[part], self.m, self.damped,
                        self.nesterov)


#: One bool per value of the largest message so far, reused (``_signs``).
_spare_signs = np.empty(0, dtype=np.bool_)


def _signs(n: int) -> np.ndarray:
    global _spare_signs
    if _spare_signs.size < n:
        _spare_signs = np.empty(n, dtype=np.bool_)
    return _spare_signs[:n]


def quantize(x: torch.Tensor) -> QuantizedArrays:
    """Quantize the 1-D float32 tensor ``x`` (gradient plus residual) to one bit per value."""
    x = x.detach().reshape(-1).to(torch.float32)
    return quantize_with_feedback(x, torch.zeros_like(x), out=torch.empty_like(x))


def dequantize(q: QuantizedArrays, into: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values a message stands for (in ``into``, float32 of at least ``numel``
    values, when given: large fresh buffers cost more in page faults than the decoding)."""
    if into is None:
        into = torch.empty(q.numel, dtype=torch.float32)
    levels = np.ascontiguousarray(q.levels, dtype=np.float32).reshape(-1, 2)
    _kernels().decode(q.bits, levels, q.numel, GROUP, _numpy(into), False)
    return into[:q.numel]


# --- the message one rank sends: levels, then extra float32 values, then the bits ------------

def message_size(numel: int, extra: int) -> int:
    """Bytes of a message for ``numel`` values and ``extra`` float32 values sent along."""
    return groups(numel) * LEVEL_BYTES + extra * 4 + -(-numel // 8)


def _levels_to_bytes(levels: np.ndarray) -> np.ndarray:
    """bfloat16 values held in float32 as their 16 high bits (exact: the low ones are 0)."""
    words = np.ascontiguousarray(levels, dtype=np.float32).reshape(-1).view(np.uint32)
    return (words >> 16).astype(np.uint16).view(np.uint8)


def _levels_from_bytes(raw: np.ndarray) -> np.ndarray:
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1, 2)


def to_message(q: QuantizedArrays, extra: torch.Tensor) -> torch.Tensor:
    """``q`` and the float32 values ``extra`` (sent exactly: the optimizer's had-gradient
    flags) as one uint8 tensor, the same size on every rank for the same ``numel``."""
    return torch.from_numpy(np.concatenate([
        _levels_to_bytes(q.levels),
        extra.detach().to(torch.float32).contiguous().numpy().view(np.uint8),
        q.bits]))


def _parts(row: np.ndarray, numel: int, extra: int) -> tuple[QuantizedArrays, np.ndarray]:
    """A message (uint8; may be padded) as its quantized values and its extra values."""
    level_bytes = groups(numel) * LEVEL_BYTES
    levels = _levels_from_bytes(row[:level_bytes])
    extras = row[level_bytes:level_bytes + extra * 4].view(np.float32)
    return QuantizedArrays(row[level_bytes + extra * 4:], levels, numel), extras


def from_message(row: np.ndarray, numel: int, extra: int,
                 into: torch.Tensor | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """The float32 values and the extra values one message (uint8; may be padded) stands for
    (the values in ``into``, as ``dequantize``)."""
    q, extras = _parts(row, numel, extra)
    return dequantize(q, into), extras


def sum_messages(rows: torch.Tensor, numel: int, extra: int,
                 total: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """Every rank's message (``rows``: world x message bytes) decoded and summed in rank
    order: the values (float32, in ``total`` when given) and the sums of the extra values. The
    same on every rank."""
    total = torch.empty(numel, dtype=torch.float32) if total is None else total
    extras = np.zeros(extra, dtype=np.float64)
    decode = _kernels().decode
    for r, row in enumerate(rows.numpy()):
        q, more = _parts(row, numel, extra)
        decode(q.bits, q.levels, numel, GROUP, _numpy(total), r > 0)  # the first one written
        extras += more
    return total, extras.tolist()


# --- stripes: reduce-scatter then allgather of 1-bit messages ---------------------------------
#
# Gathering every rank's whole message costs each rank (N-1) messages on the wire and N
# dequantizations, which grows with N. As CNTK aggregates, each rank instead owns one stripe of
# the bucket: every rank sends rank j its message for stripe j (an all-to-all), rank j sums
# the N messages of its stripe and quantizes the sum again, with a residual of its own, and
# every rank gathers every owner's message (an allgather). Each rank sends 2 (N-1)/N of one
# message whatever N, and the result is the same on every rank: they all decode the same
# gathered messages.

def stripes(numel: int, world: int) -> list[tuple[int, int]]:
    """Each rank's stripe ``(start, stop)`` of ``numel`` values: contiguous whole groups, as
    equal as whole groups allow (the last ones may be shorter, or empty)."""
    per = -(-groups(numel) // world) * GROUP
    return [(min(j * per, numel), min((j + 1) * per, numel)) for j in range(world)]


def stripe_message_size(numel: int, world: int, extra: int) -> int:
    """Bytes of every stripe's message (padded to the longest stripe's)."""
    start, stop = stripes(numel, world)[0]
    return message_size(stop - start, extra)


def _padded(message: torch.Tensor, nbytes: int) -> torch.Tensor:
    out = torch.zeros(nbytes, dtype=torch.uint8)
    out[:message.numel()] = message
    return out


def quantize_stripes(x: torch.Tensor, extra: torch.Tensor, residual: torch.Tensor,
                     out: torch.Tensor, world: int,
                     momentum: Momentum | None = None) -> torch.Tensor:
    """This rank's message for each stripe of ``x + residual`` (what it sends to the stripe's
    owner: world x stripe_message_size), with the float32 values ``extra`` in each; what the
    messages do not carry goes to ``out`` (with ``momentum``, ``x`` is the gradient and the
    correction's value is quantized)."""
    nbytes = stripe_message_size(x.numel(), world, extra.numel())
    send = torch.zeros((world, nbytes), dtype=torch.uint8)
    for row, (start, stop) in zip(send, stripes(x.numel(), world)):
        part = slice(start, stop)
        q = quantize_with_feedback(x[part], residual[part], out=out[part],
                                   momentum=None if momentum is None else momentum[part])
        message = to_message(q, extra)
        row[:message.numel()] = message
    return send


def requantize_stripe(rows: torch.Tensor, numel: int, extra: int, residual: torch.Tensor,
                      out: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """The owner's step: every rank's message for its stripe of ``numel`` values (``rows``)
    summed in rank order, plus the owner's ``residual``, as one message (padded to the size of
    ``rows``' messages) with the summed extra values; the new residual goes to ``out``
    (``total``: numel float32 to sum in, or None)."""
    total, extras = sum_messages(rows, numel, extra, total)
    q = quantize_with_feedback(total, residual, out=out)
    return _padded(to_message(q, torch.tensor(extras, dtype=torch.float32)), rows.shape[1])


def assemble(gathered: torch.Tensor, numel: int, extra: int,
             into: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """The whole sum from every owner's message (``gathered``: world x message bytes, in rank
    order), in ``into`` when given (numel float32), and the summed extra values (every
    owner sends the same ones)."""
    world = gathered.shape[0]
    if into is None:
        into = torch.empty(numel, dtype=torch.float32)
    extras = None
    for row, (start, stop) in zip(gathered.numpy(), stripes(numel, world)):
        _, more = from_message(row, stop - start, extra, into[start:])
        extras = more if extras is None else extras
    assert extras is not None  # a world has one owner at least
    return into[:numel], extras.tolist()
