"""1-bit quantization in torch operations, for buckets on a GPU: the format and arithmetic of
:mod:`ipydist.torch.training.gradients.onebit` (whose numba loops run on the CPU only), so that a
bucket on a GPU is quantized, packed, decoded and summed where it lies. Copying it to the host
each step (as 1-bit did first) cost a blocking copy of the whole bucket inside the gradient hook,
and the numba loops a CPU core, where the GPU does the same passes in microseconds.

What makes the messages the CPU path's, bit for bit:

- every value is computed by the same float32 operations in the same order (gradient plus
  residual; the momentum correction as separate roundings, never a fused multiply-add: numba
  fuses none, so the velocity is ``m * v`` rounded plus ``(1 - dampening) * g`` rounded);
- a level is ``(sum -/+ sum of magnitudes) / 2 / count`` in float32, rounded to bfloat16 by
  the kernels' own integer arithmetic (to nearest, ties to even; inf and nan keep their high
  half), not by ``.to(torch.bfloat16)``, which makes every nan the same nan;
- decoding selects one of two levels per value (exact), and the ranks' messages are added in
  rank order, one float32 addition after another, as the numba decoder adds them.

The one difference: a group's two sums. numba adds the 64 values in whatever order LLVM
vectorizes them (``fastmath={"reassoc"}``: the order depends on the CPU's vector width), torch
in its own reduction order, so the float32 sums may differ in their last bits. A level differs
only when that moves it across a bfloat16 rounding boundary: then by a bfloat16 step, and the
group's residual by as much. Measured: 15 levels in 2 million on normal gradients, 30 in 1.25
million on heavy-tailed ones, each one step of the level (the tests bound it by 2^-7 of the
group's larger level). Summing in float64 on both sides would make the levels equal in
practice, at about 10 % of the numba loop's time: the CPU path was kept as it is. The bits
(the sign of each value) are always equal for equal inputs, and so are the decoded sums,
which are what keeps the ranks identical: every rank decodes the same gathered messages.

Groups are independent and stripes are whole groups, so a rank quantizes its whole bucket at
once and cuts the messages from the result: one set of kernels per bucket, not per stripe.
Nothing here reads a value back to the host (no ``.item()``, no mask indexing, no tensor made
from a Python list on the device), so a bucket is quantized inside the gradient hook with no
synchronization; :mod:`ipydist.torch.training.gradients.onebit_exchange` moves the messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipydist.torch.training.gradients import onebit
from ipydist.torch.training.gradients.onebit import GROUP, LEVEL_BYTES, Momentum, groups


@dataclass
class QuantizedTensors:
    """One message's parts as tensors on the bucket's device: packed bits (uint8, value ``i``
    is bit ``i % 8`` of byte ``i // 8``) and per group the value of a 0 bit and of a 1 bit
    (float32 holding bfloat16 values)."""

    bits: torch.Tensor  # uint8, ceil(numel / 8)
    levels: torch.Tensor  # float32, (groups, 2)
    numel: int


_weights: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    """1, 2, 4, ..., 128 (uint8) on ``device``: made by a kernel there, not copied from the
    host (a copy from pageable memory synchronizes)."""
    if device not in _weights:
        _weights[device] = torch.bitwise_left_shift(
            torch.ones(8, dtype=torch.uint8, device=device),
            torch.arange(8, dtype=torch.uint8, device=device))
    return _weights[device]


def _to_bfloat16(levels: torch.Tensor) -> torch.Tensor:
    """float32 ``levels`` rounded to bfloat16 as ``onebit_kernels._round_to_bfloat16`` rounds
    them (in int64: the uint32 arithmetic without a signed overflow)."""
    w = levels.view(torch.int32).to(torch.int64)
    rounded = (w + 0x7FFF + ((w >> 16) & 1)) & -0x10000
    special = (w & 0x7F800000) == 0x7F800000  # inf or nan: the high half as it is
    return torch.where(special, w & -0x10000, rounded).to(torch.int32).view(torch.float32)


def _corrected(grad: torch.Tensor, momentum: Momentum, x: torch.Tensor) -> None:
    """The momentum correction's value for ``grad`` into ``x``, its new velocity into
    ``momentum.next_velocity``: ``onebit_kernels._momentum_sums``'s roundings, one by one."""
    nv = momentum.next_velocity
    torch.mul(momentum.velocity, momentum.m, out=nv)
    nv.add_(grad if momentum.damped == 1.0 else grad * momentum.damped)
    if momentum.nesterov:
        torch.mul(nv, momentum.m, out=x)
        x.add_(grad)  # grad + m * nv: one addition, either order
    else:
        x.copy_(nv)


def quantize_with_feedback(grad: torch.Tensor, residual: torch.Tensor,
                           out: torch.Tensor | None = None,
                           momentum: Momentum | None = None) -> QuantizedTensors:
    """:func:`ipydist.torch.training.gradients.onebit.quantize_with_feedback` on ``grad``'s device:
    the message for ``grad + residual`` (or the momentum correction's value for ``grad``, plus
    ``residual``), what it does not carry written to ``out`` (``residual`` when not given)."""
    grad = grad.detach().reshape(-1).to(torch.float32)
    out = residual if out is None else out
    n, g = grad.numel(), groups(grad.numel())
    pad = g * GROUP - n
    x = torch.zeros(g * GROUP, dtype=torch.float32, device=grad.device)
    if momentum is None:
        torch.add(grad, residual, out=x[:n])
    else:
        _corrected(grad, momentum, x[:n])
        x[:n].add_(residual)
    xs = x.view(g, GROUP)  # the padding is zeros: no part in the sums
    total, magnitude = xs.sum(1), xs.abs().sum(1)
    up = x >= 0
    if pad:
        up[n:] = False  # padding is neither a 1 bit nor a value
    ones = up.view(g, GROUP).sum(1)
    zeros = GROUP - ones
    if pad:
        zeros[-1:].sub_(pad)  # in place on a view: ``zeros[-1] -= pad`` would assign back
    levels = _to_bfloat16(torch.stack([
        (total - magnitude) / 2 / zeros.clamp(min=1),
        (total + magnitude) / 2 / ones.clamp(min=1)], 1))
    sent = torch.where(up.view(g, GROUP), levels[:, 1:], levels[:, :1])
    torch.sub(x[:n], sent.view(-1)[:n], out=out)
    bits = (up.view(-1, 8) * _bit_weights(x.device)).sum(1, dtype=torch.uint8)
    return QuantizedTensors(bits[:-(-n // 8)], levels, n)


def quantize(x: torch.Tensor) -> QuantizedTensors:
    """Quantize the 1-D tensor ``x`` with no residual (as ``onebit.quantize``)."""
    x = x.detach().reshape(-1).to(torch.float32)
    return quantize_with_feedback(x, torch.zeros_like(x), out=torch.empty_like(x))


def decode(bits: torch.Tensor, levels: torch.Tensor, numel: int) -> torch.Tensor:
    """The values of messages of ``numel`` values each: ``bits`` (rows x bytes, uint8, at
    least ceil(numel / 8) bytes) and ``levels`` (rows x groups x 2) as rows x numel float32."""
    rows, g = levels.shape[0], levels.shape[1]
    padded = torch.zeros((rows, g * GROUP // 8), dtype=torch.uint8, device=bits.device)
    nbytes = -(-numel // 8)
    padded[:, :nbytes] = bits[:, :nbytes]
    up = (padded.unsqueeze(-1) & _bit_weights(bits.device)) != 0
    values = torch.where(up.view(rows, g, GROUP), levels[..., 1:], levels[..., :1])
    return values.view(rows, g * GROUP)[:, :numel]


def dequantize(q: QuantizedTensors) -> torch.Tensor:
    """The float32 values one message stands for."""
    return decode(q.bits.unsqueeze(0), q.levels.unsqueeze(0), q.numel)[0]


# --- messages: levels (their 16 high bits), then extra float32 values, then the bits ----------

def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``raw`` (rows x bytes, or bytes) seen as ``dtype``; copied first where its rows
    do not start at a multiple of the item size (a message may be an odd number of bytes)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if raw.numel() == 0:  # an empty stripe's (its strides may be anything)
        return raw.new_empty((*raw.shape[:-1], raw.shape[-1] // size), dtype=dtype)
    if (not raw.is_contiguous() or raw.storage_offset() % size
            or any(stride % size for stride in raw.stride()[:-1])):
        raw = raw.clone(memory_format=torch.contiguous_format)
    return raw.view(dtype)


def _level_bytes(levels: torch.Tensor) -> torch.Tensor:
    """bfloat16 levels held in float32 as their high halves, little-endian (as numpy writes
    them on the CPU path: CPUs and NVIDIA GPUs are both little-endian)."""
    high = levels.reshape(-1).view(torch.int32) >> 16  # arithmetic: fits int16 exactly
    return high.to(torch.int16).view(torch.uint8)


def _levels_from(raw: torch.Tensor) -> torch.Tensor:
    """rows x (groups * 4) bytes of levels as rows x groups x 2 float32."""
    halves = _as(raw, torch.int16)
    words = torch.zeros((*halves.shape, 2), dtype=torch.int16, device=raw.device)
    words[..., 1] = halves
    return words.view(torch.float32).reshape(raw.shape[0], raw.shape[1] // LEVEL_BYTES, 2)


def _write(row: torch.Tensor, q: QuantizedTensors, extra_bytes: torch.Tensor) -> None:
    """One message into ``row`` (uint8, at least ``message_size`` bytes; the rest untouched)."""
    level_bytes = q.levels.shape[0] * LEVEL_BYTES
    row[:level_bytes] = _level_bytes(q.levels)
    row[level_bytes:level_bytes + extra_bytes.numel()] = extra_bytes
    start = level_bytes + extra_bytes.numel()
    row[start:start + q.bits.numel()] = q.bits


def _parts(rows: torch.Tensor, numel: int, extra: int) -> tuple:
    """Messages of ``numel`` values (rows x bytes, uint8; may be padded) as their levels
    (rows x groups x 2), extra values (rows x extra, float32) and bits (rows x bytes)."""
    level_bytes = groups(numel) * LEVEL_BYTES
    start = level_bytes + extra * 4
    return (_levels_from(rows[:, :level_bytes]), _as(rows[:, level_bytes:start], torch.float32),
            rows[:, start:start + -(-numel // 8)])


def sum_messages(rows: torch.Tensor, numel: int, extra: int,
                 total: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's message decoded and summed in rank order (``onebit.sum_messages``): the
    values (float32, in ``total`` when given) and the sums of the extra values (float32; added
    in float64 in any order, exact for the had-gradient flags, small whole numbers)."""
    levels, extras, bits = _parts(rows, numel, extra)
    values = decode(bits, levels, numel)
    total = torch.empty(numel, dtype=torch.float32, device=rows.device) if total is None else total
    total.copy_(values[0])
    for r in range(1, rows.shape[0]):  # one addition at a time, as the numba decoder adds
        total.add_(values[r])
    return total, extras.sum(0, dtype=torch.float64).to(torch.float32)


# --- stripes (see onebit): the same messages, cut from one quantization of the bucket ---------

def _full_stripes(numel: int, world: int) -> tuple[int, int]:
    """The values of a whole stripe, and how many stripes are whole: they come first, then at
    most one shorter, then empty ones (``onebit.stripes``)."""
    per = -(-groups(numel) // world) * GROUP
    return per, numel // per if per else 0


def quantize_stripes(x: torch.Tensor, extra: torch.Tensor, residual: torch.Tensor,
                     out: torch.Tensor, world: int,
                     momentum: Momentum | None = None) -> torch.Tensor:
    """``onebit.quantize_stripes`` on ``x``'s device: this rank's message for each stripe
    (world x stripe_message_size, uint8), what they do not carry in ``out``."""
    n, e = x.numel(), extra.numel()
    send = torch.zeros((world, onebit.stripe_message_size(n, world, e)), dtype=torch.uint8,
                       device=x.device)
    q = quantize_with_feedback(x, residual, out=out, momentum=momentum)
    extra_bytes = extra.detach().to(torch.float32).contiguous().view(torch.uint8)
    level_bytes, bounds = _level_bytes(q.levels), onebit.stripes(n, world)
    per, full = _full_stripes(n, world)
    if full:  # the full stripes' messages in three copies, whatever the world
        lb, nb = groups(per) * LEVEL_BYTES, per // 8
        send[:full, :lb] = level_bytes[:full * lb].view(full, lb)
        send[:full, lb:lb + 4 * e] = extra_bytes
        send[:full, lb + 4 * e:lb + 4 * e + nb] = q.bits[:full * nb].view(full, nb)
    for j, (start, stop) in enumerate(bounds[full:], full):
        if stop > start:  # the shorter one
            first, length = start // GROUP, stop - start
            _write(send[j], QuantizedTensors(q.bits[start // 8:start // 8 + -(-length // 8)],
                                      q.levels[first:first + groups(length)], length),
                   extra_bytes)
        else:  # an empty stripe's message is its extra values
            send[j:, :4 * e] = extra_bytes
            break
    return send


def requantize_stripe(rows: torch.Tensor, numel: int, extra: int, residual: torch.Tensor,
                      out: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """``onebit.requantize_stripe`` on ``rows``' device: the owner's sum of its stripe plus
    its residual as one message (padded to ``rows``' length), the new residual in ``out``."""
    total, extras = sum_messages(rows, numel, extra, total)
    q = quantize_with_feedback(total, residual, out=out)
    message = torch.zeros(rows.shape[1], dtype=torch.uint8, device=rows.device)
    _write(message, q, extras.view(torch.uint8))
    return message


def assemble(gathered: torch.Tensor, numel: int, extra: int,
             into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``onebit.assemble`` on ``gathered``'s device: the whole sum from every owner's message
    (in ``into`` when given) and the summed extra values, as a float32 tensor (reading them on
    the host waits for the device: the caller does that when it needs them)."""
    world = gathered.shape[0]
    into = torch.empty(numel, dtype=torch.float32, device=gathered.device) if into is None \
        else into
    bounds = onebit.stripes(numel, world)
    per, full = _full_stripes(numel, world)
    if full:
        levels, _, bits = _parts(gathered[:full], per, extra)
        into[:full * per].view(full, per).copy_(decode(bits, levels, per))
    start, stop = bounds[full] if full < world else (numel, numel)
    if stop > start:
        levels, _, bits = _parts(gathered[full:full + 1], stop - start, extra)
        into[start:stop] = decode(bits, levels, stop - start)[0]
    _, extras, _ = _parts(gathered[:1], bounds[0][1] - bounds[0][0], extra)
    return into[:numel], extras[0]
