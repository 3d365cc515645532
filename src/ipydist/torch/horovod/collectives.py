"""Collectives on tensors, with Horovod's names and semantics, over MPI, gloo or NCCL.

Each call makes sure the default process group exists first (user code may have destroyed it
in an earlier cell), so the API works in any cell. Tensors may live on the CPU or on the
rank's GPU: CPU tensors go over MPI when mpiexec started the ranks (``--transport``, see
:mod:`ipydist.torch._wire.transport`), else through the process group (gloo); GPU tensors through
the process group (NCCL).

Each call first checks with the other ranks that they make the same call, with the same shape
and dtype (:mod:`ipydist.torch._wire.call_check`), so a mismatch raises on every rank instead of
crashing one, corrupting the result or hanging. Each is marked with the torch.distributed
collective it stands for, the name stall warnings give a rank that waits in that check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ipydist.torch._core import process_group
from ipydist.torch._core.marks import waits_for_peers
from ipydist.torch._wire import call_check, starts
from ipydist.torch._wire.compression import Compression, Compressor
from ipydist.torch._wire.reduce_ops import ReduceOp, resolve
from ipydist.torch.horovod import autograd
from ipydist.torch.horovod.process_sets import ProcessSet, comms_for, global_process_set


@waits_for_peers("barrier")
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank (of ``process_set``) gets here (the check that every rank called
    it is the wait)."""
    process_group.ensure()
    group = comms_for(process_set)
    if call_check.enabled():
        call_check.check("barrier", group=group)
    else:  # over a group that serves CPU tensors (torch picks the device it is bound to)
        dist.barrier(group=starts.torch_group_of(group))


@waits_for_peers("all_reduce")
def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (of ``process_set``) in place and return it (``op``:
    Average by default, Sum, Min, Max, Product; ``average=`` is Horovod's deprecated form).

    ``Average`` of an integer tensor truncates, as integer division does. ``name`` is accepted
    for Horovod compatibility; torch.distributed matches collectives by order, not by name.
    """
    op = resolve(average, op)
    return starts.start_allreduce(tensor, op, prescale_factor, postscale_factor,
                                  group=comms_for(process_set)).wait()


@waits_for_peers("all_reduce")
def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return ``tensor`` reduced over all ranks (a new tensor; the input is unchanged),
    differentiable: its gradient is the same allreduce of the gradient."""
    op, group = resolve(average, op), comms_for(process_set)
    wire, ctx = compression.compress(tensor)
    if torch.is_grad_enabled() and wire.requires_grad:
        out = autograd.Allreduce.apply(wire, op, prescale_factor, postscale_factor, group)
    else:
        out = starts.start_allreduce(wire.detach().clone(), op, prescale_factor,
                                     postscale_factor, group=group).wait()
    return compression.decompress(out, ctx)


@waits_for_peers("all_reduce")
def grouped_allreduce(tensors, average=None, name: str | None = None,
                      compression: type[Compressor] = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce every tensor of ``tensors`` (posted together, waited for together) into new
    tensors, differentiable as :func:`allreduce`'s results are."""
    op, group = resolve(average, op), comms_for(process_set)
    wired = [compression.compress(t) for t in tensors]
    if torch.is_grad_enabled() and any(w.requires_grad for w, _ in wired):
        outs = [autograd.Allreduce.apply(w, op, prescale_factor, postscale_factor, group)
                for w, _ in wired]
    else:
        outs = starts.start_grouped_allreduce([w.detach().clone() for w, _ in wired], op,
                                              prescale_factor, postscale_factor, name,
                                              group).wait()
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(outs, wired)]


@waits_for_peers("all_reduce")
def grouped_allreduce_(tensors, average=None, name: str | None = None,
                       op: ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce every tensor of ``tensors`` in place."""
    op = resolve(average, op)
    tensors = list(tensors)
    starts.start_grouped_allreduce([t.detach() for t in tensors], op, prescale_factor,
                                   postscale_factor, name, comms_for(process_set)).wait()
    return tensors


@waits_for_peers("all_gather")
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order;
    differentiable (each rank's gradient is its rows of the gradient averaged over the ranks,
    as Horovod's).

    The first dimension may differ between ranks; the others must match. Each rank's first
    dimension travels in the check's header, so the check costs allgather nothing.
    """
    group = comms_for(process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return autograd.Allgather.apply(tensor, group)
    return starts.start_allgather(tensor, name, group)[0].wait()


@waits_for_peers("all_gather")
def grouped_allgather(tensors, name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather every tensor of ``tensors`` (posted together, waited for together)."""
    tensors, group = list(tensors), comms_for(process_set)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [autograd.Allgather.apply(t, group) for t in tensors]
    return starts.start_grouped("allgather", tensors, name, group).wait()


@waits_for_peers("reduce_scatter")
def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks (``op``: Average by default, Sum, Min, Max, Product)
    and return this rank's share of the rows: the first dimension is shared equally, the
    first ``rows % size()`` ranks taking one row more, as in Horovod. The input is unchanged.
    Differentiable for Average and Sum: the gradient is the allgather of the shares'
    gradients."""
    op, group = resolve(None, op), comms_for(process_set)
    wire, ctx = compression.compress(tensor)
    if torch.is_grad_enabled() and wire.requires_grad:
        out = autograd.Reducescatter.apply(wire, op, prescale_factor, postscale_factor, group)
    else:
        out = starts.start_reducescatter(wire, op, prescale_factor, postscale_factor,
                                         name, group).wait()
    return compression.decompress(out, ctx)


@waits_for_peers("reduce_scatter")
def grouped_reducescatter(tensors, name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: ReduceOp | None = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of every tensor of ``tensors`` (posted together, waited for
    together)."""
    op, group = resolve(None, op), comms_for(process_set)
    wired = [compression.compress(t) for t in tensors]
    if torch.is_grad_enabled() and any(w.requires_grad for w, _ in wired):
        outs = [autograd.Reducescatter.apply(w, op, prescale_factor, postscale_factor, group)
                for w, _ in wired]
    else:
        outs = starts.start_grouped("reducescatter", [w for w, _ in wired], name, group,
                                       op, prescale_factor, postscale_factor).wait()
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(outs, wired)]


@waits_for_peers("broadcast")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with ``root_rank``'s value, in place."""
    return starts.start_broadcast(tensor, root_rank, group=comms_for(process_set)).wait()


@waits_for_peers("broadcast")
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (a new tensor); differentiable (the
    root's gradient is the gradient averaged over the ranks, as Horovod's; the others' zero)."""
    group = comms_for(process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return autograd.Broadcast.apply(tensor, root_rank, group)
    return starts.start_broadcast(tensor.detach().clone(), root_rank, group=group).wait()


@waits_for_peers("all_to_all")
def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set):
    """Send rank j the j-th block of ``tensor``'s rows and return the blocks every rank sent
    this one, concatenated in rank order (the input is unchanged).

    ``splits`` (integers, one per rank) says how many rows go to each rank; without it the
    rows are shared equally. As in Horovod, with ``splits`` the result is ``(output,
    received_splits)``: how many rows came from each rank. Differentiable: the gradient goes
    back the way the rows came.
    """
    group = comms_for(process_set)
    if torch.is_grad_enabled() and tensor.requires_grad:
        out, received = autograd.Alltoall.apply(tensor, splits, group)
    else:
        pending, counts = starts.start_alltoall(tensor, splits, name, group)
        out, received = pending.wait(), torch.tensor(counts, dtype=torch.int32)
    return out if splits is None else (out, received)

