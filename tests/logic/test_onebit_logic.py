"""1-bit quantization with error feedback (ipydist.torch.training.gradients.onebit) on known
vectors: pure arithmetic, no cluster."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipydist.torch.training.gradients import onebit


def test_one_group_on_a_known_vector():
    q = onebit.quantize(torch.tensor([1.0, 2.0, -1.0, -3.0]))
    assert q.levels.tolist() == [[-2.0, 1.5]]  # mean of the negatives, mean of the rest
    assert q.bits.tolist() == [0b0011]
    assert onebit.dequantize(q).tolist() == [1.5, 1.5, -2.0, -2.0]


def test_bits_are_packed_little_endian_and_zero_counts_as_one():
    x = torch.tensor([1.0, -1, -1, -1, -1, -1, -1, 0.0, 5.0])
    q = onebit.quantize(x)
    assert q.bits.tolist() == [0b10000001, 0b1]
    assert q.numel == 9 and q.bits.nbytes == 2


def test_each_group_has_its_own_levels_and_padding_takes_no_part():
    n = onebit.GROUP + 10  # a full group, then a group of 10 values
    x = torch.cat([torch.full((onebit.GROUP,), 4.0), torch.tensor([-1.0] * 5 + [3.0] * 5)])
    q = onebit.quantize(x)
    assert q.levels.shape == (2, 2)
    assert q.levels[0, 1] == 4.0 and q.levels[0, 0] == 0.0  # no negatives in group 0
    assert q.levels[1].tolist() == [-1.0, 3.0]  # not pulled towards 0 by the padding
    assert onebit.dequantize(q).equal(x) and q.numel == n


def test_the_residual_is_exactly_what_was_not_sent():
    torch.manual_seed(0)
    grad, residual = torch.randn(3000), torch.randn(3000) * 0.1
    x = grad + residual
    q = onebit.quantize_with_feedback(grad, residual)
    assert residual.equal(x - onebit.dequantize(q))


def test_error_feedback_sends_everything_in_the_end():
    """Over many steps the messages plus the last residual add up to the gradients: nothing
    is lost, only delayed."""
    torch.manual_seed(1)
    residual = torch.zeros(2000, dtype=torch.float32)
    sent = torch.zeros(2000, dtype=torch.float64)
    total = torch.zeros(2000, dtype=torch.float64)
    for _ in range(50):
        grad = torch.randn(2000)
        total += grad.double()
        sent += onebit.dequantize(onebit.quantize_with_feedback(grad, residual)).double()
    assert torch.allclose(sent + residual.double(), total, atol=1e-4)
    assert residual.abs().max() < 10, "the residual stays bounded"


def test_a_message_is_at_least_20_times_smaller_than_float32():
    q = onebit.quantize(torch.randn(1 << 20))
    assert (4 << 20) / q.nbytes >= 20, q.nbytes


@pytest.mark.parametrize("n", [1, 7, 8, onebit.GROUP, 3 * onebit.GROUP + 1])
def test_quantizing_is_deterministic_and_sizes_follow_the_length(n):
    torch.manual_seed(n)
    x = torch.randn(n)
    a, b = onebit.quantize(x), onebit.quantize(x.clone())
    assert np.array_equal(a.bits, b.bits) and np.array_equal(a.levels, b.levels)
    assert a.bits.nbytes == -(-n // 8) and a.levels.shape == (onebit.groups(n), 2)
    assert onebit.dequantize(a).shape == (n,)


def test_messages_of_every_rank_sum_to_their_reconstructions():
    torch.manual_seed(2)
    n = onebit.GROUP + 100
    qs = [onebit.quantize(torch.randn(n)) for _ in range(3)]
    flags = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])]
    rows = torch.stack([onebit.to_message(q, f) for q, f in zip(qs, flags)])
    assert rows.shape == (3, onebit.message_size(n, 2)) and rows.dtype == torch.uint8
    total, extra = onebit.sum_messages(rows, n, 2)
    want = onebit.dequantize(qs[0]) + onebit.dequantize(qs[1]) + onebit.dequantize(qs[2])
    assert total.equal(want)  # the same additions in the same (rank) order: bit-identical
    assert extra == [2.0, 2.0]


@pytest.mark.parametrize("n, world", [(1, 1), (10, 4), (onebit.GROUP * 5 + 3, 2),
                                      (onebit.GROUP * 7, 3), (onebit.GROUP * 2, 4)])
def test_stripes_cover_the_bucket_in_whole_groups(n, world):
    bounds = onebit.stripes(n, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in rank order
    assert all(start % onebit.GROUP == 0 for start, stop in bounds if stop > start)
    longest = max(stop - start for start, stop in bounds)
    assert onebit.stripe_message_size(n, world, 2) == onebit.message_size(longest, 2)


def exchange_by_stripes(grads, residuals, owner_residuals, flags):
    """The 1-bit exchange of OneBitExchange for len(grads) ranks, with lists for the wire."""
    world, n = len(grads), grads[0].numel()
    new_residuals = [torch.empty(n) for _ in grads]
    sends = [onebit.quantize_stripes(g, f, r, out, world)
             for g, f, r, out in zip(grads, flags, residuals, new_residuals)]
    bounds = onebit.stripes(n, world)
    new_owner = [torch.empty_like(o) for o in owner_residuals]
    gathered = torch.stack([
        onebit.requantize_stripe(torch.stack([send[j] for send in sends]), stop - start,
                                 flags[0].numel(), owner_residuals[j], new_owner[j])
        for j, (start, stop) in enumerate(bounds)])
    return onebit.assemble(gathered, n, flags[0].numel()), new_residuals, new_owner


def test_the_exchange_by_stripes_loses_nothing_but_the_residuals():
    """What every rank decodes, plus what the owners kept back, is the sum of every rank's
    gradient and residual minus what the ranks kept back: nothing else is lost."""
    torch.manual_seed(3)
    world, n = 3, onebit.GROUP * 4 + 77
    grads = [torch.randn(n) for _ in range(world)]
    residuals = [torch.randn(n) * 0.1 for _ in range(world)]
    bounds = onebit.stripes(n, world)
    owner = [torch.randn(stop - start) * 0.1 for start, stop in bounds]
    flags = [torch.tensor([1.0, float(r == 0)]) for r in range(world)]
    (total, extras), new_residuals, new_owner = exchange_by_stripes(grads, residuals, owner,
                                                                    flags)
    assert total.shape == (n,) and extras == [3.0, 1.0]
    kept_back = torch.cat(new_owner) - torch.cat(owner)
    want = sum(g + r - nr for g, r, nr in zip(grads, residuals, new_residuals))
    assert torch.allclose(total + kept_back, want, atol=1e-4)
    assert (total - sum(grads)).abs().mean() < (sum(grads)).abs().mean()  # close to the sum


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_each_rank_sends_over_20_times_fewer_bytes_than_a_float32_allreduce(world):
    """The bar of issue 16, on a model of a million parameters, at every world size: the
    stripes keep each rank's bytes at 2 (N-1)/N of one message, as an allreduce's are."""
    from ipydist.torch._wire.transport import bytes_sent

    n = 1 << 20
    row = onebit.stripe_message_size(n, world, 1)
    onebit_bytes = bytes_sent("alltoall", world * row, world) + bytes_sent("allgather", row,
                                                                           world)
    assert bytes_sent("allreduce", 4 * n, world) / onebit_bytes >= 20
