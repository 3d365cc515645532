"""BMUF's block update on known vectors, and the block's length from CNTK's samples (pure
arithmetic; the cluster tests run it on ranks)."""

from __future__ import annotations

import pytest
import torch

from ipydist.torch.training.block_momentum import BlockState, block_steps_of, filter_block


def state_at(values):
    params = [torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))]
    return BlockState.of(params), params[0]


def test_nesterov_block_momentum_on_known_vectors():
    state, p = state_at([1.0, 2.0])
    filter_block(state, torch.tensor([2.0, 4.0], dtype=torch.float64), 0.5, 1.0, True)
    # G = [1, 2]; D = G; W = [2, 4]; the next block starts at W + 0.5 D
    assert state.update.tolist() == [1.0, 2.0]
    assert state.global_model.tolist() == [2.0, 4.0]
    assert p.tolist() == [2.5, 5.0] == state.start.tolist()
    filter_block(state, torch.tensor([3.0, 6.0], dtype=torch.float64), 0.5, 1.0, True)
    # G = [3, 6] - [2.5, 5] = [0.5, 1]; D = 0.5 [1, 2] + G = [1, 2]; W = [3, 6]
    assert state.update.tolist() == [1.0, 2.0]
    assert state.global_model.tolist() == [3.0, 6.0]
    assert p.tolist() == [3.5, 7.0]


def test_classic_block_momentum_and_block_learning_rate():
    state, p = state_at([0.0, 0.0])
    filter_block(state, torch.tensor([4.0, -4.0], dtype=torch.float64), 0.5, 0.5, False)
    assert state.update.tolist() == [2.0, -2.0]  # 0.5 * G
    assert p.tolist() == [2.0, -2.0] == state.global_model.tolist()  # no look-ahead
    filter_block(state, torch.tensor([2.0, -2.0], dtype=torch.float64), 0.5, 0.5, False)
    assert state.update.tolist() == [1.0, -1.0]  # 0.5 D + 0.5 * 0
    assert p.tolist() == [3.0, -3.0]


def test_zero_block_momentum_is_model_averaging():
    state, p = state_at([1.0, 1.0])
    for averaged in ([1.5, 0.5], [2.0, 0.25]):
        filter_block(state, torch.tensor(averaged, dtype=torch.float64), 0.0, 1.0, True)
        assert p.tolist() == averaged == state.global_model.tolist()


def test_parameters_of_several_shapes_are_laid_out_in_order():
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    state = BlockState.of(params)
    filter_block(state, torch.arange(7, dtype=torch.float32), 0.0, 1.0, True)
    assert params[0].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert params[1].tolist() == [4.0, 5.0, 6.0]


@pytest.mark.parametrize("block_size, batch_size, world, steps", [
    (512, 32, 4, 4),    # 128 samples per rank per block: 4 batches of 32
    (500, 32, 4, 4),    # 125 per rank: CNTK syncs once 125 are seen, after the 4th batch
    (4, 32, 4, 1),      # one sample per rank: the first batch ends the block
    (2048, 16, 8, 16),
])
def test_block_size_counts_samples_over_all_ranks_as_cntk_does(block_size, batch_size, world,
                                                                steps):
    assert block_steps_of(block_size, batch_size, None, world) == steps


def test_block_steps_count_optimizer_steps():
    assert block_steps_of(None, None, 3, 4) == 3


@pytest.mark.parametrize("block_size, batch_size, block_steps, world, says", [
    (64, None, None, 4, "block_size=64 counts samples, as CNTK's block_size does: also give "
                        "batch_size="),
    (None, None, None, 4, "needs the block length: block_steps=k"),
    (64, 16, 4, 4, "not both"),
    (None, 16, 4, 4, "not both"),
    (0, 16, None, 4, "block_size counts samples"),
    (3, 16, None, 4, "fewer than one per rank (4 ranks)"),
    (64, 0, None, 4, "batch_size must be the samples per rank per step"),
    (None, None, 0, 4, "block_steps must be a number of optimizer steps"),
    (None, None, 2.5, 4, "block_steps must be a number of optimizer steps"),
])
def test_a_block_length_given_wrong_says_what_to_give(block_size, batch_size, block_steps,
                                                      world, says):
    with pytest.raises(ValueError, match=None) as raised:
        block_steps_of(block_size, batch_size, block_steps, world)
    assert says in str(raised.value)
