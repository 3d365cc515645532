"""1-bit quantization in torch operations (ipydist.torch.training.gradients.onebit_torch), the
path of buckets on a GPU, run here on CPU tensors against the numba path
(ipydist.torch.training.gradients.onebit): the same bytes, levels, residuals, velocities and sums.
Pure arithmetic, no cluster.

Two kinds of data. "Dyadic" values (few significant bits) make every group's float32 sums
exact in any order, so the two paths must agree bit for bit in everything. On random values
the group sums may round differently (numba and torch add the 64 values in different orders):
the bits, the velocities and the decoded sums still agree exactly, and a level may differ
by a bfloat16 step in a few groups in a million (see onebit_torch's docstring)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipydist.torch.training.gradients import onebit
from ipydist.torch.training.gradients import onebit_torch as ot

SIZES = [1, 7, 8, onebit.GROUP, onebit.GROUP + 1, 3 * onebit.GROUP + 1, 5000]


def dyadic(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Values k/16, |k| < 64: any 64 of them (and multiples by 0.5) sum exactly in float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-63, 64, (n,), generator=g).float() / 16 * scale


def same(q: onebit.QuantizedArrays, t: ot.QuantizedTensors) -> bool:
    return (np.array_equal(q.bits, t.bits.numpy()) and np.array_equal(q.levels, t.levels.numpy())
            and q.numel == t.numel)


def test_one_group_on_a_known_vector():
    q = ot.quantize(torch.tensor([1.0, 2.0, -1.0, -3.0]))
    assert q.levels.tolist() == [[-2.0, 1.5]] and q.bits.tolist() == [0b0011]
    assert ot.dequantize(q).tolist() == [1.5, 1.5, -2.0, -2.0]


def test_padding_takes_no_part_and_its_bits_are_zero():
    x = torch.cat([torch.full((onebit.GROUP,), 4.0), torch.tensor([-1.0] * 5 + [3.0] * 5)])
    q = ot.quantize(x)
    assert q.levels.tolist() == [[0.0, 4.0], [-1.0, 3.0]]
    assert q.bits.numel() == -(-x.numel() // 8) and q.bits[-1].item() == 0b11
    assert ot.dequantize(q).equal(x)


@pytest.mark.parametrize("n", SIZES)
def test_the_same_message_and_residual_as_the_numba_path(n):
    grad, residual = dyadic(n, n), dyadic(n, n + 1, scale=0.25)
    out_a, out_b = torch.empty(n), torch.empty(n)
    q = onebit.quantize_with_feedback(grad, residual, out=out_a)
    t = ot.quantize_with_feedback(grad, residual, out=out_b)
    assert same(q, t)
    assert out_a.equal(out_b)
    assert onebit.dequantize(q).equal(ot.dequantize(t))
    flags = torch.tensor([1.0, 0.0, 1.0])  # one stripe: the message with its extras
    assert onebit.quantize_stripes(grad, flags, residual, out_a, 1).equal(
        ot.quantize_stripes(grad, flags, residual, out_b, 1))


def test_the_residual_is_written_in_place_when_no_out_is_given():
    grad, residual = dyadic(300, 1), dyadic(300, 2)
    x = grad + residual
    t = ot.quantize_with_feedback(grad, residual)
    assert residual.equal(x - ot.dequantize(t))


@pytest.mark.parametrize("settings", [dict(m=0.5, damped=1.0, nesterov=False),
                                      dict(m=0.5, damped=0.5, nesterov=True),
                                      dict(m=0.9, damped=1.0, nesterov=False),
                                      dict(m=0.9, damped=0.7, nesterov=True)],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_momentum_correction_is_rounded_as_numba_rounds_it(settings):
    """The velocity and every bit are the same: each product is rounded on its own, as numba
    computes it (no fused multiply-add). With m = 0.5 the sums are exact too, and so is all."""
    n = 3 * onebit.GROUP + 5
    if settings["m"] == 0.5:
        grad, velocity, residual = dyadic(n, 3), dyadic(n, 4), dyadic(n, 5, scale=0.25)
    else:
        torch.manual_seed(6)
        grad, velocity, residual = torch.randn(n), torch.randn(n), torch.randn(n) * 0.1
    a = onebit.Momentum(velocity.clone(), torch.empty(n), **settings)
    b = onebit.Momentum(velocity.clone(), torch.empty(n), **settings)
    out_a, out_b = torch.empty(n), torch.empty(n)
    q = onebit.quantize_with_feedback(grad, residual, out=out_a, momentum=a)
    t = ot.quantize_with_feedback(grad, residual, out=out_b, momentum=b)
    assert a.next_velocity.equal(b.next_velocity)
    assert np.array_equal(q.bits, t.bits.numpy())
    if settings["m"] == 0.5:
        assert same(q, t) and out_a.equal(out_b)
    else:
        assert_close_levels(q.levels, t.levels.numpy())


def assert_close_levels(a: np.ndarray, b: np.ndarray, rate: float = 1e-3) -> None:
    """Equal but in a few groups, where they differ by about a bfloat16 step of the group's
    larger level (the group sums rounded in another order)."""
    differ = (a != b).any(axis=1)
    assert differ.mean() <= rate, differ.mean()
    bound = 2.0 ** -7 * np.abs(a).max(axis=1, keepdims=True)
    assert (np.abs(a - b) <= bound).all()


def test_random_values_differ_at_most_in_a_few_levels_by_a_bfloat16_step():
    torch.manual_seed(7)
    n = 1 << 20
    grad, residual = torch.randn(n), torch.randn(n) * 0.3
    q = onebit.quantize_with_feedback(grad, residual, out=torch.empty(n))
    t = ot.quantize_with_feedback(grad, residual, out=torch.empty(n))
    assert np.array_equal(q.bits, t.bits.numpy())
    assert_close_levels(q.levels, t.levels.numpy(), rate=1e-4)


def test_nan_and_inf_levels_keep_their_high_half_as_numba_keeps_it():
    """bfloat16 rounding by integer arithmetic, as numba's: a nan stays the nan its high half
    makes (``.to(torch.bfloat16)`` would make every nan one nan), inf stays inf."""
    words = torch.tensor([0x7F800000, 0x7F800001, 0xFFC12345, 0x3F808000, 0x3F818000,
                          0x7F7FFFFF, 0x00000001], dtype=torch.int64).to(torch.int32)
    values = words.view(torch.float32)
    got = ot._to_bfloat16(values.clone()).view(torch.int32).tolist()
    want = np.ascontiguousarray(values.numpy()).copy()
    from ipydist.torch.training.gradients import onebit_kernels

    flat = want.view(np.uint32)
    for k in range(flat.size):
        onebit_kernels._round_to_bfloat16(flat, k)
    assert got == want.view(np.int32).tolist()


# --- the exchange by stripes ------------------------------------------------------------------

def by_stripes(ops, grads, residuals, owner_residuals, flags):
    """The exchange of OneBitExchange for len(grads) ranks with ``ops``' arithmetic (onebit
    or onebit_torch), lists for the wire: the gathered messages, the sum, the new residuals."""
    world, n = len(grads), grads[0].numel()
    new_residuals = [torch.empty(n) for _ in grads]
    sends = [ops.quantize_stripes(g, f, r, out, world)
             for g, f, r, out in zip(grads, flags, residuals, new_residuals)]
    new_owner = [torch.empty_like(o) for o in owner_residuals]
    gathered = torch.stack([
        ops.requantize_stripe(torch.stack([send[j] for send in sends]), stop - start,
                              flags[0].numel(), owner_residuals[j], new_owner[j])
        for j, (start, stop) in enumerate(onebit.stripes(n, world))])
    total, extras = ops.assemble(gathered, n, flags[0].numel())
    if isinstance(extras, torch.Tensor):
        extras = extras.tolist()
    return sends, gathered, total, extras, new_residuals, new_owner


@pytest.mark.parametrize("n, world", [(1, 1), (10, 4), (onebit.GROUP * 5 + 3, 2),
                                      (onebit.GROUP * 7, 3), (onebit.GROUP * 2, 4),
                                      (onebit.GROUP * 9 + 17, 4), (8, 4),
                                      (onebit.GROUP * 4 + 8, 8)])
def test_the_exchange_by_stripes_gives_the_same_bytes_and_sums(n, world):
    """Every message on the wire, every residual and the decoded sum, bit for bit, with
    stripes that are full, shorter and empty, messages of odd lengths. Each group has one
    magnitude, so the ranks' levels are exact and so are the owners' sums of them."""
    g = torch.Generator().manual_seed(n + world)
    magnitude = (torch.randint(1, 16, (onebit.groups(n),), generator=g).float() / 8)
    magnitude = magnitude.repeat_interleave(onebit.GROUP)[:n]
    grads = [magnitude * (torch.randint(0, 2, (n,), generator=g).float() * 2 - 1)
             for _ in range(world)]
    residuals = [torch.zeros(n) for _ in range(world)]
    owner = [torch.zeros(stop - start) for start, stop in onebit.stripes(n, world)]
    flags = [torch.tensor([1.0, float(r == 0)]) for r in range(world)]
    a = by_stripes(onebit, grads, residuals, owner, flags)
    b = by_stripes(ot, grads, residuals, owner, flags)
    for send_a, send_b in zip(a[0], b[0]):
        assert send_a.equal(send_b)
    assert a[1].equal(b[1]), "the owners' messages"
    assert a[2].equal(b[2]) and a[3] == b[3] == [float(world), 1.0]
    assert all(x.equal(y) for x, y in zip(a[4] + a[5], b[4] + b[5])), "residuals"


def test_numba_decodes_torch_messages_and_torch_decodes_numba_ones():
    """One wire format: whatever either side sent, the other sums it to the same values."""
    torch.manual_seed(8)
    n, world = onebit.GROUP * 3 + 9, 3
    rows = torch.stack([onebit.to_message(onebit.quantize(torch.randn(n)),
                                          torch.tensor([1.0, float(r)])) for r in range(world)])
    total_a, extras_a = onebit.sum_messages(rows, n, 2)
    total_b, extras_b = ot.sum_messages(rows, n, 2)
    assert total_a.equal(total_b) and extras_a == extras_b.tolist() == [3.0, 3.0]
    padded = torch.cat([rows, torch.zeros(world, 3, dtype=torch.uint8)], 1)  # odd row length
    assert ot.sum_messages(padded, n, 2)[0].equal(total_a)


def test_many_steps_on_random_values_stay_close_and_the_ranks_agree():
    """Ten steps of 4 ranks with error feedback on random gradients: the torch path's sums
    stay within quantization noise of the numba path's (a level that rounds differently
    changes the residuals from there on), and nothing is lost but the residuals."""
    torch.manual_seed(9)
    world, n = 4, onebit.GROUP * 40 + 5
    state = {ops: ([torch.zeros(n) for _ in range(world)],
                   [torch.zeros(stop - start) for start, stop in onebit.stripes(n, world)])
             for ops in (onebit, ot)}
    flags = [torch.ones(1) for _ in range(world)]
    for _ in range(10):
        grads = [torch.randn(n) for _ in range(world)]
        totals = []
        for ops, (residuals, owner) in state.items():
            _, _, total, extras, new_res, new_owner = by_stripes(ops, grads, residuals, owner,
                                                                 flags)
            want = sum(g + r - nr for g, r, nr in zip(grads, residuals, new_res))
            kept = torch.cat(new_owner) - torch.cat(owner)
            assert torch.allclose(total + kept, want, atol=1e-4) and extras == [4.0]
            state[ops] = (new_res, new_owner)
            totals.append(total)
        assert (totals[0] - totals[1]).abs().mean() < 0.05 * sum(grads).abs().mean()


def test_nothing_is_read_back_to_the_host():
    """The whole path runs on the meta device, where reading a value (``.item()``, a mask
    index, ``nonzero``, ``.tolist()``) raises: on a GPU, each would make the gradient hook wait
    for the device. Only the caller reads the summed extras, at ``step()``."""
    meta = torch.device("meta")
    n, world, extra, own = onebit.GROUP * 9 + 17, 4, 3, onebit.GROUP * 3

    def empty(k):
        return torch.empty(k, device=meta)

    momentum = onebit.Momentum(empty(n), empty(n), 0.9, 0.7, True)
    send = ot.quantize_stripes(empty(n), empty(extra), empty(n), empty(n), world, momentum)
    message = ot.requantize_stripe(send, own, extra, empty(own), empty(own))
    total, extras = ot.assemble(torch.stack([message] * world), n, extra)
    assert send.shape == (world, onebit.stripe_message_size(n, world, extra))
    assert total.shape == (n,) and extras.shape == (extra,) and total.device == meta
