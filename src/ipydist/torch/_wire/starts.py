"""The starts that every collective is built on: each checks the call with the other ranks
(:mod:`ipydist.torch._wire.call_check`), then posts the data nonblocking, over MPI for CPU tensors
where mpiexec started the ranks, else through the process group (gloo, NCCL), and returns a
:class:`~ipydist.torch._wire.handles.Pending` for its result. The blocking collectives are a start
and a wait; Horovod's ``*_async`` functions (:mod:`ipydist.torch.horovod.async_ops`) register the
start as a handle. Types the process group cannot carry travel as a wider type (int16 as int32, bool
as uint8) and come back as they were.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ipydist.torch._core import process_group, topology, waiting
from ipydist.torch._wire import adasum, call_check, handles, signature, transport
from ipydist.torch._wire.handles import Pending
from ipydist.torch._wire.reduce_ops import MPI_OPS, TORCH_OPS, Adasum, Average, ReduceOp

#: What gloo and NCCL cannot reduce or move, and the type it travels as instead.
_WIDER = {torch.int16: torch.int32, torch.bool: torch.uint8}


def _for_group(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the process group can take it: contiguous, in a type it carries."""
    if tensor.dtype in _WIDER:
        return tensor.to(_WIDER[tensor.dtype])
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _on_device(tensor: torch.Tensor) -> bool:
    return not tensor.is_cpu  # 6x faster than device.type: every collective asks


def check_root(root_rank: int, group=None) -> None:
    world = process_group.ensure().size
    if not 0 <= int(root_rank) < world:
        raise ValueError(f"root_rank={root_rank}, but ranks are 0..{world - 1}")
    if group is not None and root_rank not in group.ranks:
        raise ValueError(f"root_rank={root_rank} is not in the process set (ranks "
                         f"{group.ranks})")


def members(group=None):
    """Who takes part: the world (the Runtime), or a process set's communicators."""
    return process_group.ensure() if group is None else group


def torch_group_of(group, tensor: torch.Tensor | None = None):
    """The torch.distributed group that carries ``tensor`` among ``group``'s ranks (None: the
    default group): a CPU tensor goes over a group that serves CPU tensors, which the default
    group of an NCCL cluster may not (``process_group.cpu_group``)."""
    on_cpu = tensor is None or tensor.device.type == "cpu"
    if group is None:
        return process_group.cpu_group() if on_cpu else None
    return (group.cpu_group or group.torch_group) if on_cpu else group.torch_group


def start_allreduce(tensor: torch.Tensor, op: ReduceOp, prescale: float = 1.0,
                    postscale: float = 1.0, name: str | None = None,
                    checked: bool = False, group=None) -> Pending:
    """Start reducing ``tensor`` in place; the result is ``tensor``. ``checked``: the caller
    has already agreed on this call with the other ranks. ``group``: a process set's
    communicators (``process_sets.SetComms``), when the call is among its members."""
    handles.check_name(f"allreduce.{name}" if name else None)
    if op is Adasum:
        return _start_adasum(tensor, prescale, postscale, name, group)
    if not checked:
        call_check.check("allreduce", tensor, op=op, prescale=prescale, postscale=postscale,
                        group=group)
    if prescale != 1.0:
        scale_(tensor, prescale)
    if transport.uses_mpi(tensor, group):
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        work, mpi = transport.start_allreduce(buf, MPI_OPS[op], group=group), True
    else:
        buf = _for_group(tensor)
        work = dist.all_reduce(buf, op=TORCH_OPS[op], group=torch_group_of(group, buf),
                               async_op=True)
        mpi = False
    # the check (or the caller's) made sure of the runtime: not members(), whose look at
    # torch.distributed costs a microsecond a call
    owner = topology.get() if group is None else group
    assert owner is not None
    size = owner.size

    def finish() -> torch.Tensor:
        if buf is not tensor:
            tensor.copy_(buf)
        return _averaged(tensor, op, postscale, size)

    return Pending(work, mpi, finish, f"allreduce.{name}" if name else None,
                   "ALLREDUCE", on_device=_on_device(buf))


def _start_adasum(tensor: torch.Tensor, prescale: float, postscale: float, name: str | None,
                  group) -> Pending:
    """Start an Adasum allreduce of ``tensor`` in place (:mod:`ipydist.torch._wire.adasum`: every
    rank gathers every rank's tensor and combines them in the same tree)."""
    if not tensor.is_floating_point():
        raise ValueError(f"Adasum combines floating-point tensors, not {tensor.dtype}")
    call_check.check("allreduce", tensor, op=Adasum, prescale=prescale, postscale=postscale,
                    group=group)
    source = tensor.detach().reshape(1, -1)
    if prescale != 1.0:
        source = source * prescale
    gathering, _ = start_allgather(source, group=group)

    def finish() -> torch.Tensor:
        result = adasum.combine(list(gathering.wait().unbind(0))).view_as(tensor)
        tensor.copy_(result * postscale if postscale != 1.0 else result)
        return tensor

    return group_of([gathering], finish, f"allreduce.{name}" if name else None)


#: A tensor of a grouped allreduce this large or larger is reduced where it lies, alone:
#: copying it into a fused buffer and back cost more than the call it saved (np=2, 8 MB in 8
#: tensors: 7x plain allreduce's time fused, benchmarks/allreduce.py's grouped column).
FUSE_BELOW_BYTES = 1 << 20


def start_grouped_allreduce(tensors: list[torch.Tensor], op: ReduceOp, prescale: float = 1.0,
                            postscale: float = 1.0, name: str | None = None,
                            group=None) -> Pending:
    """Start reducing every tensor of ``tensors`` in place, fused: one check for the group,
    one flat buffer (one reduction) for each dtype and device of the small ones, the large
    ones (FUSE_BELOW_BYTES) reduced where they lie; the result is the list."""
    name = f"grouped_allreduce.{name}" if name else None
    handles.check_name(name)
    if op is Adasum:  # Adasum combines each tensor on its own: no fusion
        return group_of([start_allreduce(t, op, prescale, postscale, group=group)
                         for t in tensors], name=name)
    plan = [(str(t.dtype), t.device.type, tuple(t.shape)) for t in tensors]
    call_check.check("grouped allreduce", shape=(len(tensors),), op=op, prescale=prescale,
                    postscale=postscale, extra=signature.plan_hash(plan), group=group)
    fused: dict[tuple, list[torch.Tensor]] = {}
    parts = []
    for t in tensors:
        if t.numel() * t.element_size() >= FUSE_BELOW_BYTES:  # alone, where it lies
            parts.append(([t], t, start_allreduce(t, op, prescale, postscale, checked=True,
                                                  group=group)))
        else:
            fused.setdefault((t.dtype, t.device), []).append(t)
    for alike in fused.values():
        flat = alike[0].reshape(-1) if len(alike) == 1 else torch.cat(
            [t.reshape(-1) for t in alike])
        parts.append((alike, flat, start_allreduce(flat, op, prescale, postscale,
                                                     checked=True, group=group)))

    def finish() -> list[torch.Tensor]:
        for alike, flat, pending in parts:
            pending.wait()
            offset = 0
            for t in alike:
                if flat.data_ptr() != t.data_ptr():
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        return tensors

    return group_of([pending for _, _, pending in parts], finish, name)


def start_grouped(kind: str, tensors, name: str | None, group=None, *args) -> Pending:
    """One pending operation for an allgather or a reducescatter (``kind``) of each tensor,
    each checked and posted now (``args``: reducescatter's op and scale factors)."""
    name = f"grouped_{kind}.{name}" if name else None
    handles.check_name(name)
    if kind == "allgather":
        parts = [start_allgather(t, group=group)[0] for t in tensors]
    else:
        # args: op, prescale, postscale (never a name or a group: mypy cannot know)
        parts = [start_reducescatter(t, *args, group=group)  # type: ignore[misc]
                 for t in tensors]
    return group_of(parts, name=name)


def group_of(parts: list[Pending], finish=None, name: str | None = None) -> Pending:
    """One pending operation for several: done when all are, its result ``finish()``'s (by
    default the list of theirs)."""
    def results() -> list:
        return [part.wait() for part in parts]

    group = Pending(None, False, finish or results, name)
    group.poll = lambda: all(part.poll() for part in parts)  # type: ignore[method-assign]
    return group


def _averaged(tensor: torch.Tensor, op: ReduceOp, postscale: float,
              size: int) -> torch.Tensor:
    """``tensor``, a sum over the ranks, divided by their number for ``Average`` (integers
    truncated, as Horovod's are), then scaled by ``postscale``; in place."""
    if op is Average:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(size)
        else:
            tensor.copy_(torch.div(tensor, size, rounding_mode="trunc"))
    if postscale != 1.0:
        scale_(tensor, postscale)
    return tensor


def shares(rows: int, world: int) -> list[int]:
    """How many of ``rows`` each rank keeps in a reducescatter, as Horovod shares them: equal
    parts, and one more for each of the first ``rows % world`` ranks."""
    part, more = divmod(rows, world)
    return [part + (r < more) for r in range(world)]


def start_reducescatter(tensor: torch.Tensor, op: ReduceOp, prescale: float = 1.0,
                        postscale: float = 1.0, name: str | None = None,
                        group=None) -> Pending:
    """Start reducing ``tensor`` over the ranks, of which this rank keeps its share of the
    rows (:func:`shares`, in rank order); the input is unchanged."""
    tensor = tensor.detach()
    if op is Adasum:
        raise RuntimeError(  # Horovod's type for it
            "reducescatter takes Average, Sum, Min, Max or Product, not Adasum")
    if tensor.dim() == 0:
        raise ValueError("reducescatter shares a tensor's first dimension among the ranks: "
                         "give it a tensor with at least one dimension")
    handles.check_name(f"reducescatter.{name}" if name else None)
    call_check.check("reducescatter", tensor, op=op, prescale=prescale, postscale=postscale,
                    group=group)
    rt = members(group)
    counts, rest = shares(tensor.shape[0], rt.size), tensor.shape[1:]
    source = tensor
    if prescale != 1.0:
        source = tensor.clone()
        scale_(source, prescale)
    if transport.uses_mpi(tensor, group):
        send = source.contiguous()
        out = tensor.new_empty((counts[rt.rank], *rest))
        row = send[0].numel() if len(send) else 0
        work, mpi = transport.start_reducescatter(send, out, [n * row for n in counts],
                                                  MPI_OPS[op], group), True
    else:  # the process group wants equal blocks: each padded to the largest share
        send, most = _for_group(source), counts[0]
        blocks = send.new_zeros((rt.size, most, *rest))
        for block, part in zip(blocks, send.split(counts)):
            block[:len(part)] = part
        out = send.new_empty((most, *rest))
        work = dist.reduce_scatter_tensor(out, blocks.reshape(-1, *rest), op=TORCH_OPS[op],
                                          group=torch_group_of(group, blocks), async_op=True)
        mpi = False

    def finish() -> torch.Tensor:
        mine = out[:counts[rt.rank]]
        return _averaged(mine if mine.dtype == tensor.dtype else mine.to(tensor.dtype), op,
                         postscale, rt.size)

    return Pending(work, mpi, finish, f"reducescatter.{name}" if name else None,
                   "REDUCESCATTER", on_device=_on_device(source))


def start_allgather(tensor: torch.Tensor, name: str | None = None,
                    group=None) -> tuple[Pending, list]:
    """Start concatenating every rank's ``tensor`` along the first dimension, in rank order
    (first dimensions may differ); also returns every rank's first dimension."""
    tensor = tensor.detach()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    handles.check_name(f"allgather.{name}" if name else None)
    counts = call_check.check("allgather", tensor, shape=tensor.shape[1:],
                             carried=tensor.shape[0], group=group)
    assert counts is not None  # with carried, always every rank's
    world, longest = len(counts), max(counts)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    if transport.uses_mpi(padded, group):
        send = padded.contiguous()
        stacked = torch.empty((world, *send.shape), dtype=send.dtype)
        work, mpi, parts = transport.start_allgather(send, stacked, group), True, None
    else:
        send = _for_group(padded)
        parts = [torch.empty_like(send) for _ in range(world)]
        work, mpi = dist.all_gather(parts, send, group=torch_group_of(group, send),
                                    async_op=True), False

    def finish() -> torch.Tensor:
        if parts is None:
            if all(n == longest for n in counts):  # already in place: no copy
                return stacked.reshape(world * longest, *send.shape[1:])
            return torch.cat([g[:n] for g, n in zip(stacked.unbind(0), counts)])
        return torch.cat([g[:n] for g, n in zip(parts, counts)]).to(tensor.dtype)

    return Pending(work, mpi, finish, f"allgather.{name}" if name else None,
                   "ALLGATHER", on_device=_on_device(send)), counts


def start_broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    group=None) -> Pending:
    """Start overwriting ``tensor`` with ``root_rank``'s (a global rank), in place; the result
    is ``tensor``."""
    check_root(root_rank, group)
    handles.check_name(f"broadcast.{name}" if name else None)
    call_check.check("broadcast", tensor, root=root_rank, group=group)
    if transport.uses_mpi(tensor, group):
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        root = root_rank if group is None else group.index_of(root_rank)
        work, mpi = transport.start_broadcast(buf, root, group), True
    else:
        buf = _for_group(tensor)
        work = dist.broadcast(buf, src=root_rank, group=torch_group_of(group, buf),
                              async_op=True)
        mpi = False

    def finish() -> torch.Tensor:
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    return Pending(work, mpi, finish, f"broadcast.{name}" if name else None,
                   "BROADCAST", on_device=_on_device(buf))


def start_alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
                   group=None) -> tuple[Pending, list[int]]:
    """Start sending rank j the j-th block of ``tensor``'s rows (``splits[j]`` rows, or an
    equal share); the result is every rank's block for this rank, in rank order. Also
    returns how many rows came from each rank."""
    tensor = tensor.detach()
    world = members(group).size
    rows = tensor.shape[0] if tensor.dim() else 1
    send_rows = _splits(splits, rows, world)
    handles.check_name(f"alltoall.{name}" if name else None)
    call_check.check("alltoall", tensor, shape=tensor.shape[1:], group=group)
    row = tensor[0].numel() if tensor.dim() else 1
    if transport.uses_mpi(tensor, group):
        recv_rows = transport.exchange_counts(send_rows, group)
        send = tensor.reshape(rows, -1)[:sum(send_rows)].contiguous()
        out = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
        work = transport.start_alltoallv(send, [n * row for n in send_rows], out,
                                         [n * row for n in recv_rows], group)
        mpi = True
    else:
        mine = torch.tensor(send_rows, dtype=torch.int64)  # counts on the CPU: no device sync
        theirs = torch.empty_like(mine)
        waiting.wait_for(dist.all_to_all_single(theirs, mine, group=torch_group_of(group, mine),
                                                async_op=True))
        recv_rows = theirs.tolist()
        send = _for_group(tensor.reshape(rows, *tensor.shape[1:])[:sum(send_rows)])
        if not send.is_cpu and not process_group.nccl_serves_cuda():
            send = send.cpu()  # gloo (ranks sharing a GPU) has no all_to_all of CUDA tensors
        out = send.new_empty((sum(recv_rows), *send.shape[1:]))
        work = dist.all_to_all_single(out, send, output_split_sizes=recv_rows,
                                      input_split_sizes=send_rows,
                                      group=torch_group_of(group, send), async_op=True)
        mpi = False

    def finish() -> torch.Tensor:
        return out.to(tensor.device, tensor.dtype)

    return Pending(work, mpi, finish, f"alltoall.{name}" if name else None,
                   "ALLTOALL", on_device=_on_device(send)), recv_rows


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
