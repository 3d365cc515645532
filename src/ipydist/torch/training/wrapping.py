"""How ipydist's optimizers wrap a user's optimizer: as an instance of a subclass of its own
class, so that LR schedulers, ``isinstance`` checks and its ``step`` keep working."""

from __future__ import annotations

import warnings

import torch


def wrap(optimizer: torch.optim.Optimizer, mixin: type) -> torch.optim.Optimizer:
    """``optimizer`` as an instance of a subclass of its own class with ``mixin``'s methods
    first, sharing the original's state, param_groups and hooks (LR schedulers accept it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, not {type(optimizer).__name__}")
    base = type(optimizer)
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__
    if "step" in wrapped.__dict__:  # an LR scheduler patched the instance's step
        warnings.warn(
            f"wrap the optimizer in {mixin.wrapper_name} before creating its LR scheduler",
            stacklevel=3,
        )
    return wrapped
