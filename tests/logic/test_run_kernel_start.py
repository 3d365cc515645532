"""``ipydist run`` starts the notebook's kernel again, once, when it died before answering
(jupyter_client's ports taken between their choice and the kernel's bind): pure logic, with
stand-in clients."""

from __future__ import annotations

import pytest

from ipydist.cli.run import KERNEL_DIED_AT_START, execute_starting_again


class Client:
    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes

    def execute(self) -> None:
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome


def test_a_kernel_that_died_at_start_is_started_once_more():
    outcomes = [RuntimeError(KERNEL_DIED_AT_START), None]
    execute_starting_again(lambda: Client(outcomes))
    assert outcomes == []


def test_only_once_and_only_for_a_death_at_start():
    outcomes = [RuntimeError(KERNEL_DIED_AT_START), RuntimeError(KERNEL_DIED_AT_START), None]
    with pytest.raises(RuntimeError, match=KERNEL_DIED_AT_START):
        execute_starting_again(lambda: Client(outcomes))
    assert outcomes == [None]
    with pytest.raises(RuntimeError, match="something else"):
        execute_starting_again(lambda: Client([RuntimeError("something else"), None]))
