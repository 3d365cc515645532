"""``waiting.park``: the memory of an MPI operation a release left in flight outlives it (the
next MPI call may still write into it), and is let go once MPI is done with it. Pure logic, on
stand-ins for MPI requests; tests/cluster/test_failures.py parks a real one."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from ipydist.torch._core import waiting


class Request:
    """An MPI request's ``Test``: done when told, or failing as on a revoked communicator."""

    def __init__(self, done: bool = False, error: bool = False) -> None:
        self.done, self.error = done, error

    def Test(self) -> bool:  # noqa: N802 - MPI's name
        if self.error:
            raise RuntimeError("MPI_ERR_REVOKED")
        return self.done


@pytest.fixture(autouse=True)
def nothing_parked():
    waiting._parked.clear()
    yield
    waiting._parked.clear()


def parked_buffer(request: Request) -> weakref.ref:
    buffer = np.empty(8)
    waiting.park(request, buffer)
    return weakref.ref(buffer)


def test_the_memory_lives_until_its_operation_is_done_then_is_let_go():
    request = Request()
    buffer = parked_buffer(request)
    gc.collect()
    assert buffer() is not None and waiting.parked() == 1
    waiting.park(Request(), np.empty(1))  # each park looks at those kept before
    assert buffer() is not None and waiting.parked() == 2
    request.done = True
    waiting.park(Request(), np.empty(1))
    gc.collect()
    assert buffer() is None and waiting.parked() == 2


def test_an_operation_that_ended_in_an_error_lets_its_memory_go():
    request = Request()
    buffer = parked_buffer(request)
    request.error = True
    waiting.park(Request(done=True))
    gc.collect()
    assert buffer() is None and waiting.parked() == 0


def test_an_operation_done_by_the_time_it_is_parked_is_not_kept():
    buffer = parked_buffer(Request(done=True))
    gc.collect()
    assert buffer() is None and waiting.parked() == 0
