"""Waiting for a collective in a way a release can end.

A rank blocked in gloo or MPI does not see a KeyboardInterrupt, and gloo may never complete an
operation posted on a connection a release has closed. So ipydist's collectives start their
operations nonblocking and wait for them here, in short polls that look whether the group was
broken meanwhile.
"""

from __future__ import annotations

import datetime
import os
import time

import torch

from ipydist.torch._core import process_group, topology

#: Seconds this rank spent blocked in ipydist's collectives since :func:`take_waited` last ran.
_waited = 0.0


def note_wait(seconds: float) -> None:
    """Count ``seconds`` spent blocked in a collective (ipydist's collectives call this)."""
    global _waited
    _waited += seconds


def take_waited() -> float:
    """The seconds counted by :func:`note_wait` since the last call (``log()`` reports them,
    so a straggler shows: the slowest rank is the one that waits least)."""
    global _waited
    waited, _waited = _waited, 0.0
    return waited


#: How often a wait for a collective looks whether a release broke the group meanwhile.
_WAIT_POLL = datetime.timedelta(seconds=0.1)


def check_usable() -> None:
    """Raise at once if a release broke the group: gloo may never complete an operation
    posted on a connection it has already closed, so a rank that goes on calling collectives
    after its release (a training loop) must not post another."""
    rt = topology.get()
    if rt is not None and rt.broken and rt.group is not None:
        raise RuntimeError(process_group.RELEASED_MESSAGE)


def wait_for(work, on_device: bool = False) -> None:
    """Wait for a collective started with ``async_op=True``, raising at once if a release
    breaks the group meanwhile (see :func:`check_usable`). ``on_device``: its tensors are on
    a GPU (NCCL), whose wait only orders the device's stream and returns; the rank blocks
    later, reading the result, where NCCL's abort ends the wait and the reader must check
    the group (:func:`check_usable`) before using what it read."""
    if on_device or topology.get() is None:
        work.wait()
        return
    while True:
        try:
            work.wait(_WAIT_POLL)
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            check_usable()


def read_from_device(values: torch.Tensor) -> list:
    """``values`` (1-D) as a list, read once their device has run everything queued before,
    then the group checked (:func:`check_usable`). On a GPU a wait for a collective only
    orders the stream (:func:`wait_for`) and NCCL's abort ends its kernels early without an
    error: a read is where the host waits, and a released rank must not use what it read, nor
    anything the stream computed before. There the copy goes to pinned memory and the host
    waits on an event recorded after it (also for no values: a wait for the device alone),
    not a stream synchronization, which torch's sync debug mode reports: a training step runs
    under ``torch.cuda.set_sync_debug_mode("error")``."""
    if values.device.type != "cuda":
        read = values.tolist()
    else:
        host = values.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(values.device))
        t0 = time.perf_counter()
        done.synchronize()  # the GIL is released: a release's watcher thread runs meanwhile
        note_wait(time.perf_counter() - t0)
        read = host.tolist()
    check_usable()
    return read


def device_settled() -> None:
    """Wait until this rank's GPU has run what was queued on its current stream, then raise
    if a release broke the group meanwhile: :func:`read_from_device` with nothing to read."""
    read_from_device(torch.empty(0, device="cuda"))


#: Polling an MPI request. MPI moves a nonblocking operation only inside MPI calls, so where
#: every rank has a core of its own a wait calls ``Test`` back to back, yielding the core in
#: between (``sched_yield``, free when the core has nothing else to run): sleeping between
#: tests left a 64 MB allreduce at 0.44x raw MPI, as the operation stood still while the rank
#: slept. A check (``check_comm``) is where a rank waits for a slower one, so after
#: _SPIN_SECONDS its wait turns to sleeps, a twentieth of the time waited so far, between
#: _MPI_SLEEP_MIN and _MPI_SLEEP_MAX: a rank far behind must not find its peers spinning on its
#: cores, nor starve the engine's heartbeat. A data operation (``data_comm``) starts only once
#: every rank has passed the check, so every rank is there, and it spins until done. With more
#: ranks on a host than cores, a check never spins and a data operation spins for
#: _CROWDED_SPIN_SECONDS only, then sleeps: spinning ranks took the cores their peers, and a
#: CPU hog, needed (an interrupt then took up to 3 s to end a loop of small allreduces; with
#: checks spinning 2 ms too, once 2.1 s), while sleeping from the first test made a 4 KB
#: allreduce take 1.3 ms at np=4 on 2 cores, against 0.5 ms with data operations spinning
#: (raw MPI: 0.07-0.09 ms).
_SPIN_SECONDS = 0.02
#: For its first _TIGHT_SECONDS a wait tests back to back, not yielding in between: a small
#: operation is done by then, and a system call per test doubled its time (4 KB at np=2:
#: 5.7 us against 11.7 us; MPI's own blocking call: 5.4 us).
_TIGHT_SECONDS = 0.0002
_CROWDED_SPIN_SECONDS = 0.002
_MPI_SLEEP_MIN = 0.00005
_MPI_SLEEP_MAX = 0.02


def wait_for_mpi(request, data: bool = False) -> None:
    """Wait for a nonblocking MPI operation of ipydist's, on ``check_comm`` (or, with
    ``data``, on ``data_comm``), polling from Python: a release ends the wait
    (:func:`check_usable`, or the KeyboardInterrupt a release sends), which a blocking MPI call
    would not allow. A wait left that way leaves the operation pending, and the communicator
    is replaced by the recovery (a check marks itself pending here; a data operation stays
    in ``Runtime.data_queue`` until done, see :mod:`ipydist.torch._wire.transport`). ``request``:
    an MPI request, or anything with its ``Test()``."""
    if request.Test():  # a small operation is often done at once
        return
    rt = topology.get()
    assert rt is not None  # a wait on a communicator: a rank's runtime holds them
    if not data:
        rt.check_pending = True
    spin_for = spin_limit(rt, data)
    tight_for = 0.0 if rt.oversubscribed else _TIGHT_SECONDS
    start = time.monotonic()
    while not request.Test():
        check_usable()
        waited = time.monotonic() - start
        if waited >= tight_for:
            pause(waited, waited < spin_for)
    if not data:
        rt.check_pending = False


def spin_limit(rt: topology.Runtime | None, data: bool) -> float:
    """How long a wait spins before it sleeps (see _SPIN_SECONDS)."""
    if rt is not None and rt.oversubscribed:
        return _CROWDED_SPIN_SECONDS if data else 0.0
    return float("inf") if data else _SPIN_SECONDS


def pause(waited: float, spin: bool) -> None:
    """Between two tests of an MPI request that has been waited for ``waited`` seconds: yield
    the core (``spin``), or sleep a twentieth of the time waited so far, within bounds."""
    if spin:
        os.sched_yield()
    else:
        time.sleep(min(max(waited / 20, _MPI_SLEEP_MIN), _MPI_SLEEP_MAX))


#: MPI operations a release left in flight, each with the memory it reads and writes. The next
#: MPI call on this rank may still move one on (a peer that had posted it sends its part late),
#: writing into that memory: freed, it was reused by Python or torch (heap corruption); reused
#: by the next operation (the check's gather array), it put an old header in a new check. So
#: it is kept, never reused, until its operation is done; one a peer never posted stays for
#: the rank's life: the buffers of one operation per communicator, per release.
_parked: list[tuple] = []


def park(request, *memory) -> None:
    """Keep ``memory`` as long as ``request``, abandoned in flight, may still use it."""
    _parked[:] = [kept for kept in _parked if not _done(kept[0])]
    if not _done(request):
        _parked.append((request, memory))


def park_chains(queue) -> None:
    """:func:`park` the operation in flight of each chain in ``queue`` (a data queue whose
    communicator is dropped), with the chain, which keeps its buffers."""
    for chain in queue:
        if chain.request is not None:
            park(chain.request, chain)


def _done(request) -> bool:
    try:
        return request.Test()
    except Exception:  # ended with an error (a revoked communicator): MPI has let go of it
        return True


def parked() -> int:
    """How many abandoned operations are kept (:func:`park`)."""
    return len(_parked)


def replace_check_comm(deadline: float) -> bool:
    """A fresh ``check_comm`` and ``data_comm``, and ``node_data`` and ``cross_data`` where
    they are used (collective, nonblocking, given up at
    ``deadline``): a check or a collective a release left unfinished would otherwise be
    matched by the next one."""
    rt = topology.get()
    if rt is None or rt.control_comm is None:
        return True
    fresh_check = dup_by(rt.control_comm, deadline)
    if fresh_check is None:
        return False
    fresh_data = dup_by(rt.control_comm, deadline)
    if fresh_data is None:
        return False
    if rt.node_data is not None:  # the hierarchical allreduce's, alike (_wire.hierarchy)
        fresh_node = dup_by(rt.node_comm, deadline)
        fresh_cross = fresh_node and dup_by(rt.cross_comm, deadline)
        if fresh_cross is None:
            return False
        rt.node_data, rt.cross_data = fresh_node, fresh_cross
    rt.check_comm, rt.check_pending = fresh_check, False
    rt.data_comm = fresh_data
    park_chains(rt.data_queue)  # operations of the old communicators
    rt.data_queue.clear()
    for announced in rt.announced:
        park(announced.request, announced)
    rt.announced.clear()
    return True


def dup_by(comm, deadline: float):
    """A duplicate of ``comm`` (collective, nonblocking), or None if not every rank joined by
    ``deadline``: a rank that never comes must not hang the others."""
    fresh, request = comm.Idup()
    while not request.Test():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.002)
    return fresh
