"""``ipp.wait`` keeps a Ctrl-C a KeyboardInterrupt where threading's Event.wait turned it into
RuntimeError('release unlocked lock') (an interrupt just before its Condition takes the lock
back: once in 50 random cells beside two hogs, and the cell's ranks were not stopped)."""

from __future__ import annotations

import threading

import pytest

from ipydist.notebook import ipp


class _Waits:
    """Stands for an AsyncResult: its wait raises what ``raising`` makes."""

    def __init__(self, raising):
        self.raising = raising

    def wait(self, timeout):
        self.raising()

    wait_for_output = wait


def _interrupt_inside_the_event():
    """What Event.wait raises then: the release of a lock the interrupt kept it from taking."""
    lock = threading.Lock()
    try:
        raise KeyboardInterrupt
    finally:
        lock.release()


@pytest.mark.parametrize("output", [False, True])
def test_an_interrupt_inside_the_event_is_raised_as_an_interrupt(output):
    with pytest.raises(KeyboardInterrupt):
        ipp.wait(_Waits(_interrupt_inside_the_event), 0.05, output=output)


def test_another_runtime_error_is_left_as_it_is():
    def fails():
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        ipp.wait(_Waits(fails), 0.05)


def test_a_plain_wait_returns_its_answer():
    class Ready:
        def wait(self, timeout):
            return True

    assert ipp.wait(Ready(), 0.05) is True
