"""When a barrier lets operations in flight pass (``signature.barrier_lets_pass``): the verdict
every rank reaches from the same headers, a pure function."""

from __future__ import annotations

import torch

from ipydist.torch._wire.signature import barrier_lets_pass, disagreement, header

BARRIER = header("barrier")
ASYNC = header("allreduce", torch.float32, "cpu", (17,), deferrable=True)
BLOCKING = header("allreduce", torch.float32, "cpu", (17,))


def test_a_barrier_lets_operations_started_async_pass():
    assert barrier_lets_pass([ASYNC, BARRIER])
    assert barrier_lets_pass([BARRIER, ASYNC, BARRIER, ASYNC])
    assert barrier_lets_pass([BARRIER, header("allgather", torch.float32, "cpu", (2,),
                                              carried=3, deferrable=True)])


def test_nothing_else_passes():
    assert not barrier_lets_pass([BARRIER, BARRIER])  # the barrier itself: done
    assert not barrier_lets_pass([ASYNC, ASYNC])  # no barrier: matched as usual
    assert not barrier_lets_pass([BLOCKING, BARRIER])  # a rank would wait: a mismatch
    assert not barrier_lets_pass([ASYNC, BARRIER, BLOCKING])
    assert not barrier_lets_pass([ASYNC, header("join"), BARRIER])


def test_the_flag_is_not_compared():
    """A rank's allreduce_async meets another's blocking allreduce, as in Horovod."""
    assert disagreement([ASYNC, BLOCKING]) is None
    assert "rank 0 allreduce, rank 1 barrier" in disagreement([BLOCKING, BARRIER])
