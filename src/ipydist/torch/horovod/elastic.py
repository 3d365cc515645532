"""Horovod's elastic API (``hvd.elastic``), as it applies to ranks that live across cells.

In Horovod a script runs ``@hvd.elastic.run def train(state)``; when a peer dies, the survivors
get ``HorovodInternalError``, restore the state to its last ``commit()``, meet the new world
and call ``train`` again. Here the notebook does the meeting: the cell in which a rank died
ends (``RankDied``), the cluster heals between cells (``--elastic``: a replacement under the
dead rank's number, with rank 0's variables), and then, on every rank, each live
:class:`State` is put back to its last commit (``restore()``), made the same everywhere from
rank 0 (``sync()``), and its reset callbacks run: :func:`after_heal`. After
``Session.scale`` the states are synced and their callbacks run, with nothing restored. The
next cell calls ``train(state)`` again, which goes on from the last commit, as Horovod's
retry would. ``run`` syncs the state first, as Horovod's does, so ranks start alike.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ipydist.error_base import IpydistError
from ipydist.torch.horovod.basics import HorovodInternalError
from ipydist.torch.horovod.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TorchState", "run"]

#: Every State made on this rank, for :func:`after_heal`.
_states: weakref.WeakSet = weakref.WeakSet()
#: The number the next State gets: ranks make theirs in the same cells, so the same State has
#: the same number on every rank (a replacement's copies keep rank 0's numbers).
_next_number = 0


class HostsUpdatedInterrupt(IpydistError, RuntimeError):
    """Horovod's signal that hosts were added or removed. Never raised here: the notebook
    heals or scales between cells, so a running function is not interrupted for it."""


class State:
    """What an elastic function keeps: ``commit()`` saves it, ``restore()`` goes back to the
    last commit, ``sync()`` makes every rank's rank 0's; callbacks registered with
    ``register_reset_callbacks`` run after every heal or resize."""

    def __init__(self) -> None:
        global _next_number
        self._reset_callbacks: list[Callable[[], None]] = []
        self._number, _next_number = _next_number, _next_number + 1
        _states.add(self)

    def register_reset_callbacks(self, callbacks) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        self.save()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here when hosts changed; here they never
        change under a running cell."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        return self.__dict__

    def __setstate__(self, state: dict) -> None:  # a copy on a replacement rank is live too
        global _next_number
        self.__dict__.update(state)
        _next_number = max(_next_number, self._number + 1)
        _states.add(self)


class ObjectState(State):
    """Named values (``epoch=0, batch=0``) kept as attributes; each must pickle."""

    def __init__(self, **kwargs: Any) -> None:
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        super().__init__()
        self.save()

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        values = broadcast_object({name: getattr(self, name) for name in self._names},
                                  root_rank=0)
        for name, value in values.items():
            setattr(self, name, value)
        self.save()


class TorchState(ObjectState):
    """A model and its optimizer (either may be None), and named values, as Horovod's."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        super().__init__(**kwargs)

    def save(self) -> None:
        super().save()
        self._saved_model = (copy.deepcopy(self.model.state_dict())
                             if self.model is not None else None)
        self._saved_optimizer = (copy.deepcopy(self.optimizer.state_dict())
                                 if self.optimizer is not None else None)

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()


def run(func: Callable) -> Callable:
    """``@hvd.elastic.run``: ``func(state, ...)`` with the state synced from rank 0 first. A
    peer that dies ends the cell; the cluster heals before the next one (``--elastic``), which
    calls ``func`` again from the last commit (see the module's docstring)."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper


def after_heal(restore: bool) -> int:
    """On every rank after a heal (``restore``: back to the last commit) or a resize: each
    live state synced from rank 0 and its reset callbacks run, in the order they were made.
    Returns how many states there were."""
    states = sorted(_states, key=lambda state: state._number)  # the same order on every rank
    for state in states:
        if restore:
            state.restore()
        state.sync()
        state.on_reset()
    return len(states)
