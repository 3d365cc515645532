"""Horovod's ``*_async`` functions and grouped collectives: operations started now and waited
for later.

Each start (:mod:`ipydist.torch._wire.starts`) checks the call with the other ranks and posts its
data nonblocking, so an async operation truly overlaps what the caller does next, and
``hvd.poll(handle)`` never waits; ``hvd.synchronize(handle)`` waits and returns the result.
One started while another rank waits in ``hvd.barrier()`` is put off until after it
(``handles.start``), as Horovod's name matching lets it pass.
"""

from __future__ import annotations

import torch

from ipydist.torch._wire import handles
from ipydist.torch._wire.handles import Pending, poll, synchronize
from ipydist.torch._wire.reduce_ops import Average, ReduceOp, Sum, resolve
from ipydist.torch._wire.starts import (
    start_allgather,
    start_allreduce,
    start_alltoall,
    start_broadcast,
    start_grouped,
    start_grouped_allreduce,
    start_reducescatter,
)
from ipydist.torch.horovod.process_sets import ProcessSet, comms_for, global_process_set

__all__ = ["allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async",
           "broadcast_async", "broadcast_async_", "grouped_allgather_async",
           "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter_async",
           "poll", "reducescatter_async", "sparse_allreduce_async", "synchronize"]


# --- Horovod's async API -------------------------------------------------------------------
# Each takes Horovod's process_set= last (reducescatter's before the scale factors, as
# Horovod's do); only the set's members call it.

def allreduce_async(tensor: torch.Tensor, average=None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of a copy of ``tensor``; ``synchronize(handle)`` returns it."""
    op, group, copy = resolve(average, op), comms_for(process_set), tensor.detach().clone()
    return handles.start(lambda: start_allreduce(copy, op, prescale_factor, postscale_factor,
                                                 name, group=group), "allreduce", name, group)


def allreduce_async_(tensor: torch.Tensor, average=None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an allreduce of ``tensor`` in place; leave it alone until ``synchronize``."""
    op, group = resolve(average, op), comms_for(process_set)
    return handles.start(lambda: _returning(
        start_allreduce(tensor.detach(), op, prescale_factor, postscale_factor, name,
                        group=group), tensor), "allreduce", name, group)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather; ``synchronize(handle)`` returns the concatenation."""
    group = comms_for(process_set)
    return handles.start(lambda: start_allgather(tensor, name, group)[0], "allgather", name,
                         group)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast into a copy of ``tensor``; ``synchronize(handle)`` returns it."""
    group, copy = comms_for(process_set), tensor.detach().clone()
    return handles.start(lambda: start_broadcast(copy, root_rank, name, group), "broadcast",
                         name, group)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start a broadcast into ``tensor`` in place."""
    group = comms_for(process_set)
    return handles.start(lambda: _returning(start_broadcast(tensor.detach(), root_rank, name,
                                                            group), tensor),
                         "broadcast", name, group)


def _returning(pending: Pending, result) -> Pending:
    """``pending``, returning ``result`` (the caller's own tensor, as Horovod's in-place
    operations do, not the detached view the data went through)."""
    finish = pending.finish

    def finish_then_result():
        finish()
        return result

    pending.finish = finish_then_result
    return pending


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start an alltoall; ``synchronize(handle)`` returns what :func:`alltoall` returns."""
    group = comms_for(process_set)

    def begin() -> Pending:
        pending, received = start_alltoall(tensor, splits, name, group)
        if splits is not None:
            wait = pending.finish
            pending.finish = lambda: (wait(), torch.tensor(received, dtype=torch.int32))
        return pending

    return handles.start(begin, "alltoall", name, group)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start a reducescatter; ``synchronize(handle)`` returns this rank's share."""
    op, group = resolve(None, op), comms_for(process_set)
    return handles.start(lambda: start_reducescatter(tensor, op, prescale_factor,
                                                     postscale_factor, name, group),
                         "reducescatter", name, group)


def grouped_allreduce_async(tensors, average=None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allreduces of copies of ``tensors``; ``synchronize`` returns them as a list."""
    op, group = resolve(average, op), comms_for(process_set)
    copies = [t.detach().clone() for t in tensors]
    return handles.start(lambda: start_grouped_allreduce(
        copies, op, prescale_factor, postscale_factor, name, group),
        "grouped_allreduce", name, group)


def grouped_allreduce_async_(tensors, average=None, name: str | None = None,
                             op: ReduceOp | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start allreduces of ``tensors`` in place."""
    op, group, tensors = resolve(average, op), comms_for(process_set), list(tensors)
    return handles.start(lambda: _returning(start_grouped_allreduce(
        [t.detach() for t in tensors], op, prescale_factor, postscale_factor, name, group),
        tensors), "grouped_allreduce", name, group)


def grouped_allgather_async(tensors, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of each tensor; ``synchronize`` returns the list of results."""
    group, tensors = comms_for(process_set), list(tensors)
    return handles.start(lambda: start_grouped("allgather", tensors, name, group),
                         "grouped_allgather", name, group)


def grouped_reducescatter_async(tensors, name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor; ``synchronize`` returns the list of shares."""
    op, group, tensors = resolve(None, op), comms_for(process_set), list(tensors)
    return handles.start(lambda: start_grouped("reducescatter", tensors, name, group, op,
                                               prescale_factor, postscale_factor),
                         "grouped_reducescatter", name, group)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None,
                           op: ReduceOp | None = None,
                           process_set: ProcessSet = global_process_set):
    """Start reducing a sparse COO ``tensor``: an allgather of every rank's indices and
    values, as Horovod's. Returns a function (Horovod's handle here) that waits and returns
    the sparse sum, or for Average the sum divided by the number of ranks; entries that
    several ranks have stay as separate entries (``coalesce()`` adds them up)."""
    op = resolve(None, op)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async takes Average or Sum, not {op.name}")
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async takes a sparse COO tensor (use allreduce for "
                         "dense ones)")
    group = comms_for(process_set)
    indices = start_allgather(tensor._indices().transpose(0, 1).contiguous(),
                              f"{name}.indices" if name else None, group)[0]
    values = start_allgather(tensor._values(), f"{name}.values" if name else None, group)[0]
    ranks = process_set.size()

    def handle() -> torch.Tensor:
        every_value, every_index = values.wait(), indices.wait()
        if op is Average:
            every_value = every_value / ranks
        return torch.sparse_coo_tensor(every_index.transpose(0, 1), every_value, tensor.shape)

    return handle
