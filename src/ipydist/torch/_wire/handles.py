"""Collectives in flight, and the handles Horovod's ``*_async`` functions return.

A collective starts when it is called (its check with the other ranks, then its data posted
nonblocking on MPI or the process group) and is represented by a :class:`Pending`: ``poll``
asks whether its data has arrived without waiting, ``synchronize`` waits (a release ends the
wait) and returns its result. The blocking collectives are a start followed by a wait.

A failed or interrupted cell voids whatever was in flight (the recovery replaces the
communicators it was posted on), so :func:`abandon_all` forgets every handle: a later
``synchronize`` on one raises and says so, instead of waiting for an operation that is gone.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ipydist.torch._core import events, waiting
from ipydist.torch._core.marks import waits_for_peers
from ipydist.torch._wire import call_check, transport


@dataclass(eq=False)
class Pending:
    """One collective in flight: its wire operation (an MPI chain, a torch ``Work``, or None
    when nothing travels), and what turns the received data into the result."""

    work: Any
    mpi: bool
    finish: Callable[[], Any]
    name: str | None = None
    #: What the timeline calls it ("ALLREDUCE"...; none for a group of others), and when its
    #: data was posted.
    label: str = ""
    posted: float = field(default_factory=time.perf_counter)
    #: Its data is on a GPU (NCCL), whose wait returns before the data is there.
    on_device: bool = False

    def poll(self) -> bool:
        """Whether the data has arrived (moves an MPI operation on; never waits)."""
        if self.work is None:
            return True
        return transport.progress(self.work) if self.mpi else self.work.is_completed()

    def wait(self) -> Any:
        """Wait for the data (a release ends the wait) and return the result."""
        if self.work is not None:
            t0 = time.perf_counter()
            if self.mpi:
                transport.finish(self.work)
            else:
                waiting.wait_for(self.work, self.on_device)
            if self.on_device:  # an NCCL abort ends its kernel early, without an error: wait
                waiting.device_settled()  # for the device, then look, before any result
            waiting.note_wait(time.perf_counter() - t0)
            if events.recording and self.label:
                events.record(self.label, self.posted, time.perf_counter(), op_name=self.name,
                              wire="MPI" if self.mpi else "process group")
            self.work = None
        return self.finish()


class Later:
    """An ``*_async`` operation whose check met a barrier on another rank: nothing of it has
    moved. It starts again before this rank's next collective among the same ranks, or when
    its handle is polled or synchronized (``call_check.restart_deferred``)."""

    def __init__(self, begin: Callable[[], Pending], name: str | None, group) -> None:
        self.begin, self.name, self.group = begin, name, group
        self.started: Pending | None = None
        self.failure: BaseException | None = None
        self.restarting = False  # its own name is not a duplicate while it starts again

    def restart(self) -> None:
        self.restarting = True
        try:
            self.started = self.begin()
        except call_check.Deferred:
            raise  # put off again (a barrier still waits): not a failure, it starts later
        except BaseException as e:
            self.failure = e
            raise
        finally:
            self.restarting = False

    def _now(self) -> Pending:
        if self.started is None and self.failure is None:
            call_check.restart_deferred(self.group, deferrable_now=False)
        if self.failure is not None:
            raise self.failure
        assert self.started is not None  # restarted, or restart_deferred raised
        return self.started

    def poll(self) -> bool:
        return self._now().poll()

    def wait(self) -> Any:
        return self._now().wait()


def start(begin: Callable[[], Pending], kind: str, name: str | None, group=None) -> int:
    """Start the operation ``begin`` starts, as an ``*_async`` function does, and return its
    handle. Horovod matches operations by name, so another rank waiting in a barrier lets it
    pass (a rank may start an operation, then wait in a barrier, while another starts it only
    after the barrier): then it is put off (:class:`Later`), and started again before this
    rank's next collective among ``group``'s ranks. ``kind`` and ``name`` name it as the
    start does, so that a second operation of that name is refused meanwhile."""
    with call_check.deferrable():
        try:
            return register(begin())
        except call_check.Deferred:
            later = Later(begin, f"{kind}.{name}" if name else None, group)
            call_check.defer(later)
            return register(later)  # type: ignore[arg-type]


_pending: dict[int, Pending] = {}
_abandoned: set[int] = set()
_numbers = itertools.count(1)


def check_name(name: str | None) -> None:
    """Refuse a name that an operation still in flight has (Horovod does: two operations of
    one name would be matched to each other across ranks). Called before anything starts,
    so every rank refuses at the same call."""
    if name is not None and any(p.name == name and not getattr(p, "restarting", False)
                                for p in _pending.values()):
        raise ValueError(
            f"an operation named {name!r} is still in flight: synchronize() its handle "
            "first, or give this one another name")


def register(pending: Pending) -> int:
    """A handle for ``pending``: a number, as Horovod's."""
    handle = next(_numbers)
    _pending[handle] = pending
    return handle


def _get(handle: int) -> Pending:
    pending = _pending.get(handle)
    if pending is not None:
        return pending
    if handle in _abandoned:
        raise RuntimeError(
            f"handle {handle}'s operation was abandoned when a cell failed or was interrupted "
            "while it was in flight; start it again")
    raise ValueError(f"no operation in flight has handle {handle!r} (already synchronized?)")


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` is done (``synchronize`` then returns at once)."""
    return _get(handle).poll()


@waits_for_peers("synchronize")
def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output tensor."""
    pending = _get(handle)
    try:
        return pending.wait()
    finally:
        _pending.pop(handle, None)


def abandon_all() -> None:
    """Forget every operation in flight (a failed or interrupted cell voided them)."""
    _abandoned.update(_pending)
    _pending.clear()
    call_check.forget_deferred()
