"""Waiting for a collective in a way a release can end.

A rank blocked in gloo or MPI does not see a KeyboardInterrupt, and gloo may never complete an
operation posted on a connection a release has closed. So ipydist's collectives start their
operations nonblocking and wait for them here, in short polls that look whether the group was
broken meanwhile.
"""

from __future__ import annotations

import datetime
import time

from ipydist.torch import runtime

#: How often a wait for a collective looks whether a release broke the group meanwhile.
_WAIT_POLL = datetime.timedelta(seconds=0.1)
RELEASED_MESSAGE = ("this rank was released (a peer failed, or the cell was interrupted or "
                    "timed out): its process group is broken until the cell ends and the ranks "
                    "recover")


def check_usable() -> None:
    """Raise at once if a release broke the group: gloo may never complete an operation
    posted on a connection it has already closed, so a rank that goes on calling collectives
    after its release (a training loop) must not post another."""
    rt = runtime.get()
    if rt is not None and rt.broken and rt.group is not None:
        raise RuntimeError(RELEASED_MESSAGE)


def wait_for(work) -> None:
    """Wait for a collective started with ``async_op=True``, raising at once if a release
    breaks the group meanwhile (see :func:`check_usable`; NCCL's abort ends the wait itself)."""
    rt = runtime.get()
    if rt is None or rt.backend == "nccl":
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


#: Polling an MPI request: sleep between tests, a twentieth of the time waited so far, at least
#: _MPI_SLEEP_MIN and at most _MPI_SLEEP_MAX. Never spin or yield: with ranks on every core,
#: a rank spinning here takes the core that a peer's gloo threads need to finish the call
#: before (measured on 2 cores, np=2: yielding made a tiny allreduce 35 % slower, sleeping
#: 50 us made it 0-5 % slower), and a rank far behind must not find its peers spinning on its
#: cores, nor starve the engine's heartbeat.
_MPI_SLEEP_MIN = 0.00005
_MPI_SLEEP_MAX = 0.02


def wait_for_mpi(request) -> None:
    """Wait for a nonblocking MPI operation of ipydist's on ``check_comm``, polling from
    Python: a release ends the wait (:func:`check_usable`, or the KeyboardInterrupt a
    release sends), which a blocking MPI call would not allow. A wait left that way leaves
    the operation pending, and the communicator is replaced by the recovery."""
    rt = runtime.get()
    rt.check_pending = True
    start = time.monotonic()
    while not request.Test():
        check_usable()
        waited = time.monotonic() - start
        time.sleep(min(max(waited / 20, _MPI_SLEEP_MIN), _MPI_SLEEP_MAX))
    rt.check_pending = False


def replace_check_comm(deadline: float) -> bool:
    """A fresh ``check_comm`` (collective, nonblocking, given up at ``deadline``): a check a
    release left unfinished would otherwise be matched by the next one."""
    rt = runtime.get()
    if rt is None or rt.control_comm is None:
        return True
    fresh, request = rt.control_comm.Idup()
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    rt.check_comm, rt.check_pending = fresh, False
    rt.announced.clear()  # they belong to the old communicator
    return True
