"""Collectives started now and waited for later: Horovod's ``*_async`` functions, grouped
allreduce, and the starts that the blocking collectives are built on.

Each start checks the call with the other ranks (:mod:`ipydist.torch.agreement`), then posts
the data nonblocking: over MPI for CPU tensors where mpiexec started the ranks, else through
the process group (gloo, NCCL). So an async operation truly overlaps what the caller does
next, and ``hvd.poll(handle)`` never waits. Types the process group cannot carry travel as a
wider type (int16 as int32, bool as uint8) and come back as they were.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ipydist.torch import agreement, handles, runtime, transport, waiting
from ipydist.torch.handles import Pending, poll, synchronize
from ipydist.torch.reduce_ops import MPI_OPS, TORCH_OPS, Average, ReduceOp, resolve

#: What gloo and NCCL cannot reduce or move, and the type it travels as instead.
_WIDER = {torch.int16: torch.int32, torch.bool: torch.uint8}

__all__ = ["allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async",
           "broadcast_async",
           "broadcast_async_", "grouped_allreduce_async", "grouped_allreduce_async_", "poll",
           "synchronize"]


def _for_group(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the process group can take it: contiguous, in a type it carries."""
    if tensor.dtype in _WIDER:
        return tensor.to(_WIDER[tensor.dtype])
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def check_root(root_rank: int) -> None:
    world = runtime.ensure_process_group().size
    if not 0 <= int(root_rank) < world:
        raise ValueError(f"root_rank={root_rank}, but ranks are 0..{world - 1}")


# --- the starts ----------------------------------------------------------------------------

def start_allreduce(tensor: torch.Tensor, op: ReduceOp, prescale: float = 1.0,
                    postscale: float = 1.0, name: str | None = None) -> Pending:
    """Start reducing ``tensor`` in place; the result is ``tensor``."""
    handles.check_name(f"allreduce.{name}" if name else None)
    agreement.agree("allreduce", tensor, op=op, prescale=prescale, postscale=postscale)
    if prescale != 1.0:
        scale_(tensor, prescale)
    if transport.uses_mpi(tensor):
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        work, mpi = transport.start_allreduce(buf, MPI_OPS[op]), True
    else:
        buf = _for_group(tensor)
        work, mpi = dist.all_reduce(buf, op=TORCH_OPS[op], async_op=True), False

    def finish() -> torch.Tensor:
        if buf is not tensor:
            tensor.copy_(buf)
        if op is Average:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(runtime.get().size)
            else:  # integer division truncates, as Horovod's does
                tensor.copy_(torch.div(tensor, runtime.get().size, rounding_mode="trunc"))
        if postscale != 1.0:
            scale_(tensor, postscale)
        return tensor

    return Pending(work, mpi, finish, f"allreduce.{name}" if name else None)


def start_allgather(tensor: torch.Tensor, name: str | None = None) -> tuple[Pending, list]:
    """Start concatenating every rank's ``tensor`` along the first dimension, in rank order
    (first dimensions may differ); also returns every rank's first dimension."""
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    handles.check_name(f"allgather.{name}" if name else None)
    counts = agreement.agree("allgather", tensor, shape=tensor.shape[1:],
                             carried=tensor.shape[0])
    world, longest = len(counts), max(counts)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    if transport.uses_mpi(padded):
        send = padded.contiguous()
        stacked = torch.empty((world, *send.shape), dtype=send.dtype)
        work, mpi, parts = transport.start_allgather(send, stacked), True, None
    else:
        send = _for_group(padded)
        parts = [torch.empty_like(send) for _ in range(world)]
        work, mpi = dist.all_gather(parts, send, async_op=True), False

    def finish() -> torch.Tensor:
        if parts is None:
            if all(n == longest for n in counts):  # already in place: no copy
                return stacked.reshape(world * longest, *send.shape[1:])
            return torch.cat([g[:n] for g, n in zip(stacked.unbind(0), counts)])
        return torch.cat([g[:n] for g, n in zip(parts, counts)]).to(tensor.dtype)

    return Pending(work, mpi, finish, f"allgather.{name}" if name else None), counts


def start_broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> Pending:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; the result is ``tensor``."""
    check_root(root_rank)
    handles.check_name(f"broadcast.{name}" if name else None)
    agreement.agree("broadcast", tensor, root=root_rank)
    if transport.uses_mpi(tensor):
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        work, mpi = transport.start_broadcast(buf, root_rank), True
    else:
        buf = _for_group(tensor)
        work, mpi = dist.broadcast(buf, src=root_rank, async_op=True), False

    def finish() -> torch.Tensor:
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    return Pending(work, mpi, finish, f"broadcast.{name}" if name else None)


def start_alltoall(tensor: torch.Tensor, splits=None,
                   name: str | None = None) -> tuple[Pending, list[int]]:
    """Start sending rank j the j-th block of ``tensor``'s rows (``splits[j]`` rows, or an
    equal share); the result is every rank's block for this rank, in rank order. Also
    returns how many rows came from each rank."""
    tensor = tensor.detach()
    world = runtime.ensure_process_group().size
    rows = tensor.shape[0] if tensor.dim() else 1
    send_rows = _splits(splits, rows, world)
    handles.check_name(f"alltoall.{name}" if name else None)
    agreement.agree("alltoall", tensor, shape=tensor.shape[1:])
    row = tensor[0].numel() if tensor.dim() else 1
    if transport.uses_mpi(tensor):
        recv_rows = transport.exchange_counts(send_rows)
        send = tensor.reshape(rows, -1)[:sum(send_rows)].contiguous()
        out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
        work = transport.start_alltoallv(send, [n * row for n in send_rows], out,
                                         [n * row for n in recv_rows])
        mpi = True
    else:
        mine = torch.tensor(send_rows, dtype=torch.int64, device=tensor.device)
        theirs = torch.empty_like(mine)
        waiting.wait_for(dist.all_to_all_single(theirs, mine, async_op=True))
        recv_rows = theirs.tolist()
        send = _for_group(tensor.reshape(rows, *tensor.shape[1:])[:sum(send_rows)])
        out = send.new_empty((sum(recv_rows), *send.shape[1:]))
        work = dist.all_to_all_single(out, send, output_split_sizes=recv_rows,
                                      input_split_sizes=send_rows, async_op=True)
        mpi = False

    def finish() -> torch.Tensor:
        return out.to(tensor.dtype)

    return Pending(work, mpi, finish, f"alltoall.{name}" if name else None), recv_rows


def _splits(splits, rows: int, world: int) -> list[int]:
    """Rows for each rank: ``splits`` checked, or an equal share of ``rows``."""
    if splits is None:
        if rows % world:
            raise ValueError(
                f"alltoall without splits sends each rank an equal share of the first "
                f"dimension, but {rows} rows do not divide among {world} ranks: pass splits")
        return [rows // world] * world
    splits = torch.as_tensor(splits)
    if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
        raise ValueError(f"alltoall splits must be integers (int32), not {splits.dtype}")
    counts = [int(n) for n in splits.reshape(-1).tolist()]
    if len(counts) != world or any(n < 0 for n in counts):
        raise ValueError(f"alltoall splits must be {world} counts of rows (one per rank, none "
                         f"negative), not {counts}")
    if sum(counts) > rows:
        raise ValueError(f"alltoall splits send {sum(counts)} rows, but the tensor has {rows}")
    return counts


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply ``tensor`` by ``factor`` in place as Horovod does: integers in float64, then
    truncated; 16-bit floats in float32."""
    if tensor.dtype in (torch.float32, torch.float64) or tensor.is_complex():
        tensor.mul_(factor)
    else:
        wide = torch.float64 if not tensor.is_floating_point() else torch.float32
        tensor.copy_((tensor.to(wide) * factor).to(tensor.dtype))


# --- Horovod's async API -------------------------------------------------------------------

def allreduce_async(tensor: torch.Tensor, average=None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0) -> int:
    """Start an allreduce of a copy of ``tensor``; ``synchronize(handle)`` returns it."""
    op = resolve(average, op)
    return handles.register(start_allreduce(tensor.detach().clone(), op, prescale_factor,
                                            postscale_factor, name))


def allreduce_async_(tensor: torch.Tensor, average=None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0) -> int:
    """Start an allreduce of ``tensor`` in place; leave it alone until ``synchronize``."""
    op = resolve(average, op)
    return handles.register(_returning(
        start_allreduce(tensor.detach(), op, prescale_factor, postscale_factor, name), tensor))


def allgather_async(tensor: torch.Tensor, name: str | None = None) -> int:
    """Start an allgather; ``synchronize(handle)`` returns the concatenation."""
    return handles.register(start_allgather(tensor, name)[0])


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start a broadcast into a copy of ``tensor``; ``synchronize(handle)`` returns it."""
    return handles.register(start_broadcast(tensor.detach().clone(), root_rank, name))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Start a broadcast into ``tensor`` in place."""
    return handles.register(_returning(start_broadcast(tensor.detach(), root_rank, name),
                                       tensor))


def _returning(pending: Pending, result) -> Pending:
    """``pending``, returning ``result`` (the caller's own tensor, as Horovod's in-place
    operations do, not the detached view the data went through)."""
    finish = pending.finish

    def finish_then_result():
        finish()
        return result

    pending.finish = finish_then_result
    return pending


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None) -> int:
    """Start an alltoall; ``synchronize(handle)`` returns what :func:`alltoall` returns."""
    pending, received = start_alltoall(tensor, splits, name)
    if splits is not None:
        wait = pending.finish
        pending.finish = lambda: (wait(), torch.tensor(received, dtype=torch.int32))
    return handles.register(pending)


def _grouped(tensors, op, prescale, postscale, name) -> Pending:
    """One pending operation for allreduces of every tensor (each checked and posted now)."""
    tensors = list(tensors)
    name = f"grouped_allreduce.{name}" if name else None
    handles.check_name(name)
    parts = [start_allreduce(t, op, prescale, postscale) for t in tensors]

    def finish() -> list[torch.Tensor]:
        return [part.wait() for part in parts]

    group = Pending(None, False, finish, name)
    group.poll = lambda: all(part.poll() for part in parts)  # type: ignore[method-assign]
    return group


def grouped_allreduce_async(tensors, average=None, name: str | None = None,
                            op: ReduceOp | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> int:
    """Start allreduces of copies of ``tensors``; ``synchronize`` returns them as a list."""
    op = resolve(average, op)
    return handles.register(_grouped([t.detach().clone() for t in tensors], op,
                                     prescale_factor, postscale_factor, name))


def grouped_allreduce_async_(tensors, average=None, name: str | None = None,
                             op: ReduceOp | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0) -> int:
    """Start allreduces of ``tensors`` in place."""
    op = resolve(average, op)
    tensors = list(tensors)
    return handles.register(_returning(_grouped([t.detach() for t in tensors], op,
                                                prescale_factor, postscale_factor, name),
                                       tensors))


def grouped(tensors, op: ReduceOp, prescale: float, postscale: float,
            name: str | None) -> list[torch.Tensor]:
    """Allreduce every tensor of ``tensors`` in place (detached views of them, or copies):
    posted together, waited together."""
    return _grouped(tensors, op, prescale, postscale, name).wait()
