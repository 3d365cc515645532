"""BMUF's block update on known vectors (pure arithmetic; the cluster tests run it on ranks)."""

from __future__ import annotations

import torch

from ipydist.torch.block_momentum import BlockState, filter_block


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
