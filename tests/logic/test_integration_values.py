"""Pure logic: what a framework logged, as the numbers ``hvd.log`` takes."""

import numpy as np
import torch

from ipydist.integrations.values import numbers


def test_single_numbers_of_every_kind_become_floats():
    logged = {"loss": torch.tensor(0.5), "acc": np.float32(0.25), "step": 3, "lr": 1e-3,
              "one": torch.tensor([2.0]), "arr": np.array([4.0])}
    assert numbers(logged) == {"loss": 0.5, "acc": 0.25, "step": 3.0, "lr": 1e-3, "one": 2.0,
                               "arr": 4.0}


def test_what_is_not_one_number_is_left_out():
    logged = {"name": "run-1", "flag": True, "many": torch.ones(3), "list": [1.0],
              "none": None, "z": 1 + 2j, "t_flag": torch.tensor(True)}
    assert numbers(logged) == {}
