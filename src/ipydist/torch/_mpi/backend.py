"""``--backend mpi``: a torch.distributed backend over mpi4py, so that DDP, FSDP and plain
``torch.distributed`` calls on CPU tensors move their data as fast as ipydist's own collectives.

The torch wheels on PyPI are built without MPI, and torch's own MPI backend blocks in C++ where
a release cannot end the wait. This one is registered as ``mpi4py``
(``Backend.register_backend``; a ``ProcessGroup`` subclassed in Python, as PyTorch's own tests
do). Each collective is posted nonblocking on the group's own communicator (a duplicate of the
world's, so it never meets user or ipydist MPI traffic), from the calling thread, so every rank
posts them in program order. A progress thread per group tests the posted requests (MPI moves
a nonblocking operation only inside MPI calls) and completes each one's future: DDP's reducer
waits on those futures in C++, while backward goes on (overlap), and a release, a timeout or an
MPI error completes them with an error, so ``loss.backward()`` raises instead of hanging.

Data: CPU tensors only (a CUDA tensor raises, naming ``--backend nccl``). Reductions run on the
tensor's own memory through numpy (float16 and bfloat16 through a float32 copy: MPI has no
16-bit float reduction); broadcasts, gathers and point-to-point move raw bytes, any dtype.
"""

from __future__ import annotations

import math
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.futures import Future

from ipydist.protocol import MPI_BACKEND
from ipydist.torch._core import topology, waiting
from ipydist.torch._mpi.progress import Posted, Progress, Work
from ipydist.torch._wire import transport

#: The name the backend is registered under (``dist.get_backend()`` says it).
NAME = MPI_BACKEND
_RED = dist.ReduceOp.RedOpType
_UPCAST = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
#: How a bool tensor is reduced: as uint8 0/1, SUM and OR being MAX, PRODUCT and AND being MIN.
_BOOL_OPS = {_RED.SUM: "MAX", _RED.MAX: "MAX", _RED.BOR: "MAX", _RED.PRODUCT: "MIN",
             _RED.MIN: "MIN", _RED.BAND: "MIN"}
_OPS = {_RED.SUM: "SUM", _RED.AVG: "SUM", _RED.PREMUL_SUM: "SUM", _RED.PRODUCT: "PROD",
        _RED.MIN: "MIN", _RED.MAX: "MAX", _RED.BAND: "BAND", _RED.BOR: "BOR", _RED.BXOR: "BXOR"}


def _mpi():
    from mpi4py import MPI

    return MPI


def _check_cpu(tensors) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise RuntimeError(
                f"the {NAME} backend (--backend mpi) carries CPU tensors, not {t.device.type} "
                "ones: use --backend nccl for GPU tensors, or move the tensor to the CPU.")


def _bytes(t: torch.Tensor):
    """A contiguous tensor's memory as MPI bytes (broadcast, gather and send need no type)."""
    return [t.detach().reshape(-1).view(torch.uint8).numpy(), _mpi().BYTE]


class _Reduced:
    """A tensor as MPI reduces it: its own memory when MPI has its type and it is contiguous,
    else a copy (float32 for 16-bit floats, uint8 for bool) that :meth:`finish` writes back."""

    def __init__(self, tensor: torch.Tensor, op: dist.ReduceOp, size: int) -> None:
        kind = op.op if hasattr(op, "op") else op
        MPI = _mpi()
        self.tensor, self.divide = tensor, size if kind == _RED.AVG else None
        if tensor.dtype == torch.bool:
            if kind not in _BOOL_OPS:
                raise RuntimeError(f"the {NAME} backend cannot reduce bool tensors with {kind}")
            self.buf = tensor.detach().contiguous().view(torch.uint8)
            self.op = getattr(MPI, _BOOL_OPS[kind])
        else:
            if kind not in _OPS:
                raise RuntimeError(f"the {NAME} backend has no reduce op {kind}")
            if tensor.is_complex() and kind not in (_RED.SUM, _RED.AVG, _RED.PREMUL_SUM,
                                                    _RED.PRODUCT):
                raise RuntimeError(f"the {NAME} backend cannot reduce complex tensors with {kind}")
            wire = _UPCAST.get(tensor.dtype)
            self.buf = tensor.detach().to(wire) if wire else tensor.detach().contiguous()
            self.op = getattr(MPI, _OPS[kind])
            if self.divide and not self.buf.is_floating_point() and not self.buf.is_complex():
                raise RuntimeError(f"the {NAME} backend averages floating-point tensors only")
        if kind == _RED.PREMUL_SUM:
            factor = op.factor if not isinstance(op.factor, torch.Tensor) else op.factor.item()
            self.buf = self.buf * factor  # a copy: the caller's input is not scaled
        self.view = self.buf.reshape(-1).numpy()

    def finish(self) -> None:
        if self.divide:
            self.buf.div_(self.divide)
        if self.buf.data_ptr() != self.tensor.data_ptr() or self.buf.dtype != self.tensor.dtype:
            with torch.no_grad():
                self.tensor.copy_(self.buf.view(torch.bool) if self.tensor.dtype == torch.bool
                                  else self.buf)


def _finish_all(parts: list[_Reduced]) -> None:
    for p in parts:
        p.finish()


class MPIProcessGroup(dist.ProcessGroup):
    """A process group whose collectives go over MPI (see the module docstring)."""

    def __init__(self, comm, rank: int, size: int, timeout_s: float) -> None:
        super().__init__(rank, size)  # torch 2.13 refuses (store, rank, size) from Python
        self._comm, self._rank, self._size, self._timeout_s = comm, rank, size, timeout_s
        self._progress = Progress(f"group-of-{size}")
        self._progress.start()
        self._abandoned: list = []  # buffers of operations a release left posted
        self._group_name = self._group_desc = ""

    # --- what torch asks of every group ------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"MPIProcessGroup(rank={self._rank}, size={self._size})"

    # --- life --------------------------------------------------------------------------------
    def release(self, message: str) -> None:
        """Fail every posted collective with ``message``, and every later one at once (a
        release broke the group; the recovery makes a new one)."""
        self._abandoned.extend(self._progress.fail(message))

    def shutdown(self) -> None:
        self._progress.stop()

    def abort(self) -> None:
        self.release(f"the {NAME} process group was aborted")

    def _post(self, tensors, posts, finish=None, result=None, keep=None) -> Work:
        """Submit the operations ``posts`` (functions that post one each) to the progress
        thread, which posts them in order and, once done, runs ``finish`` and completes the
        future with ``result``."""
        _check_cpu(tensors)
        future = Future()
        self._progress.post(Posted(posts, future, finish, tensors if result is None else
                                   result, keep, time.monotonic() + self._timeout_s))
        return Work(future)

    # --- collectives (as torch.distributed and DDP's reducer call them) ----------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        _check_cpu(tensors)
        parts = [_Reduced(t, op, self._size) for t in tensors]
        in_place = _mpi().IN_PLACE
        return self._post(
            tensors, [partial(self._comm.Iallreduce, in_place, piece, p.op)
                      for p in parts for piece in transport.pieces(p.view)],
            finish=lambda: _finish_all(parts), keep=parts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        flats = [t.detach().contiguous() for t in tensors]
        return self._post(
            tensors, [partial(self._comm.Ibcast, _bytes(f), root=opts.rootRank) for f in flats],
            finish=lambda: _write_back(tensors, flats), keep=flats)

    def allgather(self, output_lists, inputs, opts=None):
        sends = [t.detach().contiguous() for t in inputs]
        stacks = [torch.empty((self._size, *s.shape), dtype=s.dtype) for s in sends]

        def finish():
            for outs, stack in zip(output_lists, stacks):
                for out, row in zip(outs, stack.unbind(0)):
                    out.detach().copy_(row.view(out.shape))

        return self._post(
            inputs, [partial(self._comm.Iallgather, _bytes(s), _bytes(d))
                     for s, d in zip(sends, stacks)],
            finish=finish, result=output_lists, keep=(sends, stacks))

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's name
        send = input.detach().contiguous()
        into = output.detach() if output.is_contiguous() else torch.empty_like(output)
        return self._post(
            [output, input], [partial(self._comm.Iallgather, _bytes(send), _bytes(into))],
            finish=lambda: _write_back([output], [into]), result=[output], keep=(send, into))

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts):
        works = [self.reduce_scatter_single(out, torch.cat([t.reshape(-1) for t in ins]), opts)
                 for out, ins in zip(outputs, input_lists)]
        for work in works[:-1]:
            work.wait()
        return works[-1]

    def reduce_scatter_single(self, output, input, opts):  # noqa: A002
        send = _Reduced(input, opts.reduceOp, self._size)
        got = _Reduced(output, opts.reduceOp, self._size)
        return self._post(
            [output, input],
            [partial(self._comm.Ireduce_scatter_block, send.view, got.view, send.op)],
            finish=got.finish, result=[output], keep=(send, got))

    _reduce_scatter_base = reduce_scatter_single

    def reduce(self, tensors, opts):
        parts = [_Reduced(t, opts.reduceOp, self._size) for t in tensors]
        root, in_place = opts.rootRank, _mpi().IN_PLACE
        return self._post(
            tensors, [partial(self._comm.Ireduce, in_place if self._rank == root else p.view,
                              p.view if self._rank == root else None, p.op, root=root)
                      for p in parts],
            finish=lambda: _finish_all(parts) if self._rank == root else None,
            keep=parts)

    def gather(self, output_lists, inputs, opts):
        send = inputs[0].detach().contiguous()
        root = opts.rootRank
        stack = torch.empty((self._size, *send.shape), dtype=send.dtype)

        def finish():
            for out, row in zip(output_lists[0] if output_lists else [], stack.unbind(0)):
                out.detach().copy_(row.view(out.shape))

        return self._post(
            inputs, [partial(self._comm.Igather, _bytes(send), _bytes(stack), root=root)],
            finish=finish, result=output_lists, keep=(send, stack))

    def scatter(self, outputs, input_lists, opts):
        into = outputs[0].detach().contiguous()
        root = opts.rootRank
        stack = (torch.stack([t.detach() for t in input_lists[0]]) if self._rank == root
                 else into.new_empty((self._size, *into.shape)))
        return self._post(
            outputs, [partial(self._comm.Iscatter, _bytes(stack), _bytes(into), root=root)],
            finish=lambda: _write_back(outputs, [into]), keep=(stack, into))

    def alltoall_base(self, output, input, output_splits, input_splits, opts):  # noqa: A002
        send = input.detach().contiguous()
        into = output.detach() if output.is_contiguous() else torch.empty_like(output)
        row_bytes = math.prod(send.shape[1:]) * send.element_size()  # dims after the first

        def counts(splits, total):
            rows = list(splits) or [total // self._size] * self._size
            sizes = [n * row_bytes for n in rows]
            return sizes, [sum(sizes[:i]) for i in range(len(sizes))]

        sent, got = counts(input_splits, send.shape[0]), counts(output_splits, into.shape[0])
        byte = _mpi().BYTE
        return self._post(
            [output, input], [partial(self._comm.Ialltoallv, [_bytes(send)[0], sent, byte],
                                      [_bytes(into)[0], got, byte])],
            finish=lambda: _write_back([output], [into]), result=[output], keep=(send, into))

    def barrier(self, opts=None):
        return self._post([], [self._comm.Ibarrier], result=[])

    def send(self, tensors, dst, tag):
        flats = [t.detach().contiguous() for t in tensors]
        return self._post(tensors, [partial(self._comm.Isend, _bytes(f), dest=dst, tag=tag)
                                    for f in flats], keep=flats)

    def alltoall(self, outputs, inputs, opts=None):
        raise RuntimeError(_unserved("alltoall (all_to_all of tensor lists); all_to_all_single "
                                     "is served"))

    def recv_anysource(self, tensors, tag):
        raise RuntimeError(_unserved("recv from any source; recv(src=...) is served"))

    def recv(self, tensors, src, tag):
        flats = [t.detach().contiguous() for t in tensors]
        return self._post(tensors, [partial(self._comm.Irecv, _bytes(f), source=src, tag=tag)
                                    for f in flats],
                          finish=lambda: _write_back(tensors, flats), keep=flats)


def _unserved(what: str) -> str:
    return (f"the {NAME} backend (--backend mpi) does not provide {what}: use a gloo group for "
            "it (dist.new_group(backend='gloo')), or --backend gloo.")


def _write_back(tensors, copies) -> None:
    for t, c in zip(tensors, copies):
        if c.data_ptr() != t.data_ptr():
            t.detach().copy_(c.view(t.shape))


def _create(common, _backend_options) -> MPIProcessGroup:
    """The creator torch calls, collectively over the group's members, for each new group."""
    MPI = _mpi()
    rt = topology.get()
    world = rt.comm if rt is not None and rt.comm is not None else MPI.COMM_WORLD
    members = list(common.global_ranks_in_group)
    timeout_s = common.timeout.total_seconds()
    if members and members != list(range(world.size)):
        group = world.Get_group().Incl(members)
        comm = world.Create_group(group)
        group.Free()
    else:
        if world.size != common.group_size:
            raise RuntimeError(
                f"the {NAME} backend needs ranks started by mpiexec or srun: MPI sees "
                f"{world.size} process(es), torch.distributed {common.group_size}")
        comm = waiting.dup_by(world, time.monotonic() + timeout_s)
        if comm is None:
            raise RuntimeError(f"creating the {NAME} process group timed out: not every rank "
                               "joined")
    return MPIProcessGroup(comm, common.group_rank, common.group_size, timeout_s)


def register() -> None:
    """Make ``backend="mpi4py"`` known to torch.distributed (in this process; idempotent)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def is_ours(group) -> bool:
    return isinstance(group, MPIProcessGroup)

