"""How ipydist's optimizers wrap a user's optimizer: as an instance of a subclass of its own
class, so that LR schedulers, ``isinstance`` checks and its ``step`` keep working."""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    #: What a mixin's methods may count on: the class it is mixed into (``wrap``) is an
    #: optimizer's. To mypy only; at run time the mixins derive from object, as before.
    OptimizerMixinBase = torch.optim.Optimizer
else:
    OptimizerMixinBase = object


class Mixin(Protocol):
    """A class ``wrap`` mixes in: it names the wrapper, for the user."""

    wrapper_name: str


def wrap(optimizer: torch.optim.Optimizer, mixin: type[Mixin]) -> torch.optim.Optimizer:
    """``optimizer`` as an instance of a subclass of its own class with ``mixin``'s methods
    first, sharing the original's state, param_groups and hooks (LR schedulers accept it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, not {type(optimizer).__name__}")
    base = type(optimizer)
    cls: type[torch.optim.Optimizer] = type(base.__name__, (mixin, base),
                                            {"__module__": base.__module__})
    wrapped = cls.__new__(cls)  # type: ignore[call-overload]  # torch skipped: type[Any]
    wrapped.__dict__ = optimizer.__dict__
    if "step" in wrapped.__dict__:  # an LR scheduler patched the instance's step
        warnings.warn(
            f"wrap the optimizer in {mixin.wrapper_name} before creating its LR scheduler",
            stacklevel=3,
        )
    return wrapped


class OutsideTheSet:
    """A DistributedOptimizer on a rank outside its process set, mixed in as ``wrap`` does.

    Horovod lets every rank make ``DistributedOptimizer(opt, process_set=ps)``, members of
    ``ps`` or not (its own test does, with the even ranks' set on every rank), and a rank
    outside the set then trains alone: its steps average nothing and it takes part in no
    collective of the set. The methods code calls on a DistributedOptimizer do nothing here.
    """

    wrapper_name = "DistributedOptimizer"
    #: Nothing is sent, as nothing is averaged.
    bytes_sent = 0

    def synchronize(self) -> None:
        """Nothing to wait for: this rank averages with no one."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    @property
    def _parameter_names(self) -> dict:
        return {}
