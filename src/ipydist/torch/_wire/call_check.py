"""The call check: every rank compares a collective call's signature before its data moves.

One mechanism, one name: "the check" in the README and errors, ``IPYDIST_CHECK_COLLECTIVES``,
this module; the timeline alone labels it ``NEGOTIATE_<OP>``, Horovod's name for the phase.

Collectives are matched by order, not by name: when ranks disagree on what the next one is,
gloo aborts the process ("message sizes differ"), or the data is reduced as the wrong dtype
without a word, or a broadcast from two different roots waits forever. Horovod's coordinator
compares every rank's request first and raises on all of them; ipydist does the same without a
coordinator. Each checked call first describes itself in a header of HEADER_WORDS integers
(what kind of call, dtype, device, shape, reduce op, root, scale factors and one word the call
chooses), and the ranks all-gather their headers: one small collective, the same size whatever
the call, so even ranks in two different kinds of call meet in it safely. Every rank then sees
every header and reaches the same verdict, so on a mismatch all of them raise the same
RuntimeError, no data has moved, and the process group is fine for the next call. One
disagreement is not a mismatch: ranks in a barrier meeting operations that other ranks started
with an ``*_async`` function, which Horovod's name matching lets pass. The barrier then waits
on, and those operations are put off (:class:`Deferred`) and started again before their rank's
next collective (:func:`restart_deferred`).

Under mpiexec the exchange is an MPI all-gather on a communicator kept for it (a few
microseconds where a gloo collective takes a fraction of a millisecond), polled from Python so
that a release ends the wait; a check left unfinished that way is why the recovery replaces the
communicator. Elsewhere it goes through torch.distributed on the rank's own group (its GPU's,
with NCCL). Either way the wait happens inside the ipydist function that asked for the check,
which is marked as the collective it stands for, so stall warnings and releases treat it as
one. ``benchmarks/call_check.py`` measures the cost; ``IPYDIST_CHECK_COLLECTIVES=0`` or
:func:`set_enabled` turns it off on every rank. It checks what ipydist's own collectives are
asked to do; raw torch.distributed calls and DDP's buckets go unchecked.
"""

from __future__ import annotations

import enum
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

from ipydist import protocol
from ipydist.torch._core import events, process_group, topology, waiting
from ipydist.torch._wire.signature import (
    CARRIED,
    HEADER_WORDS,
    KIND,
    KINDS,
    barrier_lets_pass,
    disagreement,
    header,
)

_enabled = os.environ.get(protocol.CHECK_COLLECTIVES_ENV, "1").strip() != "0"
#: (device, world size) -> (every rank's header, as one tensor and as a list of its rows),
#: reused: the exchange is waited for before it returns, so no two calls share one in flight.
_buffers: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}
_CPU = torch.device("cpu")
#: Headers already built, by the arguments of :func:`header` (at most _HEADERS_KEPT).
_headers: dict[tuple, np.ndarray] = {}
_HEADERS_KEPT = 512


class Deferred(Exception):  # noqa: N818 (a signal, caught by handles.start, not an error)
    """The ``*_async`` call being started met a barrier on another rank: nothing of it moved,
    and it starts again later (``handles.Later``)."""


#: Whether the call being started now may be put off by a barrier (an ``*_async`` start).
_deferrable = False
#: Calls put off by a barrier, oldest first: each has ``group`` (the process set's
#: communicators, None for the world) and ``restart()``.
_later: deque = deque()
_restarting = False


@contextmanager
def deferrable(on: bool = True) -> Iterator[None]:
    """Mark the checks made inside as those of an ``*_async`` start, which a barrier on
    another rank puts off instead of failing (``signature.barrier_lets_pass``)."""
    global _deferrable
    before, _deferrable = _deferrable, on
    try:
        yield
    finally:
        _deferrable = before


def defer(later) -> None:
    """Keep ``later`` to start again before this rank's next collective among its ranks."""
    _later.append(later)


def restart_deferred(group=None, deferrable_now: bool = True) -> bool:
    """Start again, oldest first, the calls a barrier put off among ``group`` (None: the
    world); False if one was put off again (it and those after it stay put off). They come
    before any later collective, so every rank's calls keep their order. With
    ``deferrable_now`` False (a handle polled or synchronized: the caller will wait for it),
    a barrier on another rank is a mismatch and raises."""
    global _restarting
    if _restarting or not _later:
        return True
    _restarting = True
    try:
        for later in [w for w in _later if w.group is group]:
            with deferrable(deferrable_now):
                try:
                    later.restart()
                except Deferred:
                    return False
                finally:
                    if later.started is not None or later.failure is not None:
                        _later.remove(later)
        return True
    finally:
        _restarting = False


def forget_deferred() -> None:
    """Drop the calls put off (a failed or interrupted cell voided them)."""
    _later.clear()


def enabled() -> bool:
    """Whether ipydist's collectives check their signature across ranks first."""
    return _enabled


def set_enabled(on: bool) -> None:
    """Turn the check on or off. Do it on every rank (in an ``%%everyrank`` cell): a rank that
    checks and one that does not would meet header against data."""
    global _enabled
    _enabled = bool(on)


class Announced:
    """A header this rank sent ahead of its call (see :func:`announce`)."""

    __slots__ = ("request", "mine", "every", "settled", "problem", "sent")

    def __init__(self, request, mine: np.ndarray, every: np.ndarray) -> None:
        self.request, self.mine, self.every = request, mine, every  # MPI reads them meanwhile
        self.sent = time.perf_counter()
        self.settled = False
        self.problem: str | None = None


def announce(words: np.ndarray) -> Announced | None:
    """Send this rank's header for a call it will make soon, without waiting for the others.

    The optimizer announces its step at ``zero_grad()``, so that by the time its first bucket
    leaves, the exchange has long finished and the check costs a test, not a wait: a blocking
    check there made every step wait for the slowest rank's backward plus a wake-up, 10 % of
    a short step. Exchanges on ``check_comm`` are matched in the order they are posted, so an
    announced header meets the other ranks' announced headers, and every later check is
    matched after it. Only over MPI (a collective posted ahead through torch.distributed would
    meet the data of the other ranks' next collective). ``words``: the call's :func:`header`
    as int64 (a caller that announces often builds it once). None where nothing was sent.
    """
    rt = topology.get()
    if not _enabled or rt is None or rt.size == 1 or rt.check_comm is None or rt.broken:
        return None
    if _later and not restart_deferred():  # they come first; one still put off: check later
        return None
    every = np.empty((rt.size, HEADER_WORDS), dtype=np.int64)
    found = Announced(rt.check_comm.Iallgather(words, every), words, every)
    # MPI moves a nonblocking collective only inside MPI calls: one test now sends this rank's
    # header, so that a peer finds it waiting when it settles, without waiting for this rank
    found.request.Test()
    rt.announced.append(found)
    return found


def usable(announced: Announced | None) -> bool:
    """Whether a call can rely on what it announced: sent, on the current communicator, and
    not found to mismatch (a mismatch raised already; the call checks again)."""
    if announced is None or announced.problem is not None:
        return False
    rt = topology.get()
    return announced.settled or (rt is not None and announced in rt.announced)


def settle(upto: Announced | None = None) -> None:
    """Finish the announced exchanges in the order they were sent, up to ``upto`` (all of them
    when None), raising on the first that shows a mismatch. Every check does this first, so a
    rank whose announced call never came still meets the others' announcements in order."""
    rt = topology.get()
    if upto is not None and upto.settled:
        return
    while rt is not None and rt.announced:
        found = rt.announced[0]
        waiting.wait_for_mpi(found.request)
        rt.announced.popleft()
        found.settled = True
        if events.recording:  # from when it was sent: the check overlaps the backward pass
            events.checked(KINDS[int(found.mine[KIND]) - 1], found.sent, time.perf_counter())
        found.problem = disagreement(found.every.tolist())
        if found.problem is not None:
            raise RuntimeError(found.problem)
        if found is upto:
            return


def check(kind: str, tensor: torch.Tensor | None = None, *, dtype: torch.dtype | None = None,
          device: torch.device | None = None, shape: Sequence[int] | None = None,
          op: enum.Enum | str | None = None, root: int = -1, prescale: float = 1.0,
          postscale: float = 1.0, extra: int = 0, carried: int | None = None,
          group=None) -> list[int] | None:
    """Check with every other rank that they make the same call; raise RuntimeError on every
    rank if not (collective: every rank calls it).

    ``tensor`` gives dtype, device and shape unless they are given. With ``carried``, the
    headers are exchanged even with the check off, and every rank's ``carried`` comes back in
    rank order (allgather sends its first dimension that way, at no extra cost). ``group``:
    the communicators of a process set (``process_sets.SetComms``) whose members make the
    call, instead of the world's.
    """
    rt = process_group.ensure()
    waiting.check_usable()
    if rt.announced:
        settle()
    if _later and kind != "barrier" and not restart_deferred(group) and _deferrable:
        raise Deferred  # one before it was put off again: so is this one, to keep the order
    group = rt if group is None else group
    if group.size == 1 or not (_enabled or carried is not None):
        return None if carried is None else [carried]
    if tensor is not None:
        dtype = tensor.dtype if dtype is None else dtype
        device = tensor.device if device is None else device
        shape = tensor.shape if shape is None else shape
    key = (kind, dtype, device, tuple(shape) if shape is not None else None, op, root,
           prescale, postscale, extra, carried or 0, _deferrable)
    mine = _headers.get(key)
    if mine is None:  # a training loop repeats a few calls: build each header once
        if len(_headers) >= _HEADERS_KEPT:
            _headers.clear()
        mine = _headers[key] = np.asarray(header(*key), dtype=np.int64)
    started = time.perf_counter()
    if group.check_comm is not None and carried is None and not events.recording:
        # the common case, a call every rank makes alike: one comparison of bytes, not a
        # verdict from lists of words (4 KB at np=2: 1.5 us of the check's 5.5)
        every = _gather_over_mpi(group, mine)
        if _enabled and every.tobytes() == mine.tobytes() * group.size:
            return None
        headers = every.tolist()
    else:
        headers = _exchange(group, mine)
    if events.recording:
        events.checked(kind, started, time.perf_counter(),
                          None if group is rt else group.size)
    if _enabled:
        problem = disagreement(headers)
        while problem is not None and barrier_lets_pass(headers):
            if kind != "barrier":
                raise Deferred
            headers = _exchange(group, mine)  # the others put theirs off: wait on for them
            problem = disagreement(headers)
        if problem is not None:
            raise RuntimeError(problem)
    return None if carried is None else [h[CARRIED] for h in headers]


def exchange_joined(first: bool) -> list[list[int]]:
    """Every rank's header, this rank sending a "join" one (it waits in ``hvd.join()``);
    ``first``, carried along, marks its first exchange since it joined. Raises nothing: a
    joined rank serves what the others agree on, and sits out what they raise on."""
    rt = process_group.ensure()
    waiting.check_usable()
    if rt.announced:
        settle()
    restart_deferred()
    return _exchange(rt, np.asarray(header("join", carried=int(first)), dtype=np.int64))


def _exchange(group, words: np.ndarray) -> list[list[int]]:
    """Every rank's header, in rank order (of the world, or of a process set: ``group``).

    Over MPI when mpiexec started the ranks: a nonblocking all-gather on a communicator kept
    for these checks, polled from Python, costs microseconds where a gloo collective costs a
    fraction of a millisecond. Otherwise through the process group. Either way it is waited
    for here, so that the innermost collective on the stack is the ipydist function that
    called :func:`check` (marked with the torch.distributed name it stands for, e.g.
    ``all_reduce``): stall warnings and release reports name what the user called, and a
    release ends the wait (see ``waiting.wait_for_mpi``).
    """
    if group.check_comm is not None:
        return _exchange_over_mpi(group, words)
    # on the CPU, over a group that serves it: the header is a few numbers, and on a GPU its
    # reading would sync the device
    device = _CPU
    pg = (group.cpu_group or group.torch_group) if hasattr(group, "torch_group") else (
        process_group.cpu_group())
    every, rows = _buffers.get((device, group.size, pg)) or _allocate(device, group.size, pg)
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    t0 = time.perf_counter()
    waiting.wait_for(dist.all_gather(rows, mine, group=pg, async_op=True))
    found = every.tolist()
    waiting.note_wait(time.perf_counter() - t0)  # the straggler strip counts it as waiting
    return found


def _exchange_over_mpi(group, words: np.ndarray) -> list[list[int]]:
    return _gather_over_mpi(group, words).tolist()


#: World size -> the array every rank's header is gathered into, reused: the exchange is
#: waited for before the array is read, and read before the next exchange. One an exchange
#: left by a release is dropped and parked with it (``waiting.park``): the abandoned exchange
#: may still write into it.
_gathered: dict[int, np.ndarray] = {}


def _gather_over_mpi(group, words: np.ndarray) -> np.ndarray:
    every = _gathered.pop(group.size, None)
    if every is None:
        every = np.empty((group.size, HEADER_WORDS), dtype=np.int64)
    t0 = time.perf_counter()
    request = group.check_comm.Iallgather(words, every)
    try:
        waiting.wait_for_mpi(request)
    except BaseException:
        waiting.park(request, words, every)
        raise
    waiting.note_wait(time.perf_counter() - t0)  # the straggler strip counts it as waiting
    _gathered[group.size] = every
    return every


def _allocate(device: torch.device, size: int, pg) -> tuple[torch.Tensor, list[torch.Tensor]]:
    every = torch.empty((size, HEADER_WORDS), dtype=torch.int64, device=device)
    _buffers[(device, size, pg)] = every, list(every.unbind(0))
    return _buffers[(device, size, pg)]
