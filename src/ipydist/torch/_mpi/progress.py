"""Futures and the progress thread of ipydist's MPI backend (:mod:`ipydist.torch._mpi.backend`).

MPI moves a nonblocking collective only inside MPI calls, and DDP's reducer waits for its
buckets on torch futures, in C++. So each group has a thread that tests the requests it posted,
in the order they were posted, and completes their futures: with the result, or with an error
(a release, the group's timeout, an MPI error), so that the wait in C++ raises and
``loss.backward()`` with it.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time
import weakref

import torch.distributed as dist
from torch.futures import Future

from ipydist.protocol import MPI_BACKEND as NAME
from ipydist.torch._core import topology, waiting


class Work(dist._Work):
    """A posted collective. C++ (DDP's reducer) calls only ``wait`` and ``get_future``."""

    def __init__(self, future: Future) -> None:
        super().__init__()
        # Future.set_exception is Python-only: it stores the error as a result, which DDP's
        # reducer would take for the gradients (a crash). A future derived with then() whose
        # callback re-raises carries a real error that C++ raises. Everything here looks at
        # the derived one: it completes after the first (its callback runs then), so a wait
        # on the first could return before get_future()'s value exists.
        self._future = future.then(lambda f: f.value())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        if seconds <= 0:  # C++ passes 0 for "no timeout"
            self._future.wait()
            return True
        deadline = time.monotonic() + seconds
        while not self._future.done():  # torch's futures have no timed wait
            if time.monotonic() > deadline:
                raise RuntimeError(f"{NAME} collective wait timed out after {seconds:g} s")
            time.sleep(0.0005)
        self._future.value()  # raises what the operation raised
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self):
        try:
            self._future.value()
        except Exception as e:
            return e
        return None

    def result(self):
        return self._future.value()

    def synchronize(self) -> None:
        pass


class Posted:
    """A collective submitted to a group: the MPI operations that make it (the pieces of a
    large reduction, see ``transport.pieces``), which the progress thread posts one after
    another, and the future it completes once the last is done."""

    __slots__ = ("posts", "request", "future", "finish", "result", "keep", "deadline")

    def __init__(self, posts, future, finish, result, keep, deadline) -> None:
        self.posts, self.request, self.future, self.finish = iter(posts), None, future, finish
        self.result, self.keep, self.deadline = result, keep, deadline

    def advance(self) -> bool:
        """Post the next operation once the last one is done; True when all are done."""
        while self.request is None or self.request.Test():
            post = next(self.posts, None)
            if post is None:
                return True
            self.request = post()
        return False


#: Every progress thread, stopped at exit (see :meth:`Progress.stop`).
_running: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for thread in list(_running):
        thread.fail("the process is exiting")
        thread.stop()


class Progress(threading.Thread):
    """Posts a group's collectives, in the order they were submitted (the same on every rank),
    tests them, and completes their futures; sleeps on a condition while nothing is
    submitted. Only this thread touches the group's communicator. It spins (``sched_yield``
    between tests), for a short while only where ranks outnumber cores, as ipydist's own waits
    do (``waiting.spin_limit``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=f"ipydist-{NAME}-{name}", daemon=True)
        _running.add(self)
        self.posted: list[Posted] = []
        self.ready = threading.Condition()
        self.failure: str | None = None
        self.stopped = False

    def post(self, posted: Posted) -> None:
        with self.ready:
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self.posted.append(posted)
            self.ready.notify()

    def fail(self, message: str) -> list[Posted]:
        """Complete every submitted future with ``message`` and take no more (what was posted
        stays posted: the buffers are returned, to be kept while MPI may still write them)."""
        with self.ready:
            self.failure = message
            left, self.posted = self.posted, []
            self.ready.notify()
        for p in left:
            _settle(p.future, error=RuntimeError(message))
        return left

    def stop(self, wait: float = 1.0) -> None:
        """End the thread once what was submitted is done (or failed), waiting up to
        ``wait`` seconds: a thread still running when the interpreter exits may be inside
        torch's C++ code, where ending it aborts the process."""
        with self.ready:
            self.stopped = True
            self.ready.notify()
        if threading.current_thread() is not self:
            self.join(wait)

    def run(self) -> None:
        spin_for = waiting.spin_limit(topology.get(), data=True)
        idle_since = None
        while True:
            with self.ready:
                while not self.posted and not self.stopped and self.failure is None:
                    self.ready.wait()
                    idle_since = None
                if (self.stopped and not self.posted) or self.failure is not None:
                    return
                first = self.posted[0]
            try:
                done = first.advance()
            except Exception as e:  # an MPI error: the collective failed here
                self.fail(f"{NAME} collective failed: {e}")
                return
            if done:
                with self.ready:
                    if self.posted and self.posted[0] is first:
                        self.posted.pop(0)
                self._complete(first)
                idle_since = None
                continue
            now = time.monotonic()
            if now > first.deadline:
                self.fail(f"{NAME} collective timed out: a rank did not join it within the "
                          "process group's timeout")
                return
            idle_since = idle_since or now
            waiting.pause(now - idle_since, now - idle_since < spin_for)

    @staticmethod
    def _complete(posted: Posted) -> None:
        try:
            if posted.finish is not None:
                posted.finish()
        except Exception as e:
            _settle(posted.future, error=e)
            return
        _settle(posted.future, result=posted.result)


def _settle(future: Future, result=None, error: Exception | None = None) -> None:
    """Complete ``future`` unless it is complete already: a release can fail it from another
    thread just as the operation finishes here."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except RuntimeError:  # completed meanwhile
        pass
