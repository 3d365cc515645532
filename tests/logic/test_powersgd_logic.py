"""PowerSGD's arithmetic (``ipydist.torch.training.gradients.powersgd``), with N ranks emulated
in one process: each rank's real exchange object prepares its step, the test sums what the
allreduces would sum, and each writes the result into a real bucket. The cluster tests run it
over MPI and gloo between real ranks."""

from __future__ import annotations

import pytest
import torch

from ipydist.torch._wire.compression import Compression, describe
from ipydist.torch.training.gradients.buckets import Bucket
from ipydist.torch.training.gradients.powersgd import (
    PowerSGDExchange,
    orthonormalize,
    plan,
    seeded_q,
)


def test_plan_compresses_matrices_that_gain_and_sends_the_rest_whole():
    shapes = [torch.Size(s) for s in [(16, 1, 3, 3), (16,), (64, 512), (10, 64), (10,)]]
    matrices, whole = plan(shapes, rank=4, min_compression_rate=2.0)
    # 16 x 9 at rank 4 sends 100 of 144 values: under 2x, whole; 64 x 512 sends 2304 of 32768
    assert [(m.rows, m.cols, m.rank) for m in matrices] == [(64, 512, 4), (10, 64, 4)]
    assert whole == [(0, 144), (144, 16), (144 + 16 + 32768 + 640, 10)]
    assert matrices[1].start == 144 + 16 + 32768
    assert (matrices[1].p_at, matrices[1].q_at) == (64 * 4, 512 * 4)
    # rank larger than a side: the side's
    (m,), _ = plan([torch.Size((3, 50))], rank=8, min_compression_rate=0.1)
    assert m.rank == 3


def test_orthonormalize_and_the_shared_seed():
    m = torch.randn(20, 4, dtype=torch.float64)
    orthonormalize(m)
    assert torch.allclose(m.t() @ m, torch.eye(4, dtype=torch.float64), atol=1e-12)
    a = seeded_q(30, bucket=2, step=7, dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(a, seeded_q(30, 2, 7, torch.float32, torch.device("cpu")))
    assert not torch.equal(a, seeded_q(30, 2, 8, torch.float32, torch.device("cpu")))
    assert not torch.equal(a, seeded_q(30, 3, 7, torch.float32, torch.device("cpu")))


def exchange_step(exchanges: list[PowerSGDExchange], buckets: list[Bucket],
                  flats: list[torch.Tensor], step: int) -> None:
    """One step among the emulated ranks: prepare, the first allreduce, the second half,
    the second allreduce, write."""
    for ex, flat in zip(exchanges, flats):
        ex._prepare(flat, step)
    total = sum(ex._step["first"] for ex in exchanges)  # what travels whole, and the Ps
    for ex in exchanges:
        ex._step["first"].copy_(total)
    qs = [ex._second_half() for ex in exchanges]
    total = sum(qs)
    for q in qs:
        q.copy_(total)
    for ex, bucket in zip(exchanges, buckets):
        flags = [f.item() for f in ex.to_read()]
        ex.write(bucket, flags, prescale=1.0, postscale=1.0, sparse_as_dense=False)


def ranks(world: int, rank: int, shapes) -> tuple[list[PowerSGDExchange], list[Bucket]]:
    exchanges, buckets = [], []
    for _ in range(world):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        buckets.append(Bucket(params, sum(p.numel() for p in params)))
        exchanges.append(PowerSGDExchange([p.shape for p in params], rank, 2.0, world))
    return exchanges, buckets


def flat_of(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads] + [torch.ones(len(grads))])


def test_a_sum_of_rank_at_most_r_comes_back_exact_and_the_vectors_whole():
    world, shapes = 4, [(32, 64), (32,)]
    exchanges, buckets = ranks(world, 4, shapes)
    gen = torch.Generator().manual_seed(0)
    # each rank's gradient of rank 1 (a batch of one): the sum has rank 4
    grads = [[torch.outer(torch.randn(32, generator=gen), torch.randn(64, generator=gen)),
              torch.randn(32, generator=gen)] for _ in range(world)]
    exchange_step(exchanges, buckets, [flat_of(g) for g in grads], step=0)
    for bucket in buckets:
        got = [p.grad for p in bucket.params]
        assert torch.allclose(got[0], sum(g[0] for g in grads), atol=1e-4)
        assert torch.equal(got[1], sum(g[1] for g in grads))  # sent whole: exact
    # error feedback: M - P Q^T / N, summing to about zero over the ranks
    assert torch.allclose(sum(ex.error for ex in exchanges), torch.zeros(32 * 64), atol=1e-4)
    # the ranks keep one Q
    assert all(torch.equal(ex.q, exchanges[0].q) for ex in exchanges)


def test_error_feedback_carries_what_a_low_rank_step_left_out():
    """Rank 1 for a sum of full rank: what one step does not carry, later steps do. The sum
    of what the steps delivered is the sum of the gradients less what the ranks' error
    feedback holds now, which stays bounded: the relative gap shrinks as 1 / steps."""
    world, shapes = 2, [(16, 16)]
    exchanges, buckets = ranks(world, 1, shapes)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(16, 16, generator=gen) for _ in range(world)]
    delivered, gaps = torch.zeros(16, 16), {}
    for step in range(400):
        exchange_step(exchanges, buckets, [flat_of([g]) for g in grads], step)
        delivered += buckets[0].params[0].grad
        if step + 1 in (200, 400):
            wanted = (step + 1) * sum(grads)
            held = sum(ex.error for ex in exchanges).view(16, 16)
            assert torch.allclose(delivered + held, wanted, rtol=1e-4, atol=1e-2)
            gaps[step + 1] = ((delivered - wanted).norm() / wanted.norm()).item()
    assert gaps[400] < 0.05 and gaps[400] < 0.75 * gaps[200], gaps
    # without error feedback a single step's relative error is large
    one = ranks(world, 1, shapes)
    exchange_step(*one, [flat_of([g]) for g in grads], 0)
    assert (one[1][0].params[0].grad - sum(grads)).norm() / sum(grads).norm() > 0.3


def test_restart_drops_q_and_every_rank_draws_the_same_next_one():
    exchanges, buckets = ranks(2, 2, [(8, 8)])
    grads = [torch.randn(8, 8), torch.randn(8, 8)]
    exchange_step(exchanges, buckets, [flat_of([g]) for g in grads], 0)
    exchanges[0].restart()  # as after a recovery: every rank restarts
    exchanges[1].restart()
    assert exchanges[0].q is None
    for ex, g in zip(exchanges, grads):
        ex._prepare(flat_of([g]), 5)
    assert torch.equal(exchanges[0]._step["q"], exchanges[1]._step["q"])


def test_state_round_trips_through_a_checkpoint():
    exchanges, buckets = ranks(2, 2, [(8, 8)])
    grads = [torch.randn(8, 8), torch.randn(8, 8)]
    exchange_step(exchanges, buckets, [flat_of([g]) for g in grads], 0)
    saved = exchanges[0].state()
    fresh = PowerSGDExchange([torch.Size((8, 8))], 2, 2.0, 2)
    fresh.load(saved)
    fresh._prepare(flat_of([grads[0]]), 1)
    exchanges[0]._prepare(flat_of([grads[0]]), 1)
    assert torch.equal(fresh._step["p"], exchanges[0]._step["p"])


def test_the_compressor_says_what_it_is_and_refuses_bad_parameters():
    assert describe(Compression.powersgd(rank=4)) == (
        "Compression.powersgd(rank=4, start_iter=10, min_compression_rate=2)")
    assert Compression.powersgd(rank=4) == Compression.powersgd(rank=4)
    assert Compression.powersgd(rank=4) != Compression.powersgd(rank=2)
    for bad in ({"rank": 0}, {"rank": 2.5}, {"start_iter": -1}, {"min_compression_rate": 0}):
        with pytest.raises(ValueError, match="Compression.powersgd: "):
            Compression.powersgd(**bad)
    with pytest.raises(ValueError, match="works only in DistributedOptimizer"):
        Compression.powersgd(rank=2).compress(torch.ones(3))
