"""How the bytes of rank 0's tensors reach the replacements in a heal (``state_copy`` pickles
everything else, leaving the tensors' storages out of the pickle).

Neither side copies the state: rank 0 sends each storage from the tensor's own memory, and a
replacement receives it into the memory its tensor then uses. A replacement on rank 0's host
gets them through shared memory: rank 0 writes them once into a file in ``/dev/shm`` (at
memory speed; several replacements on the host share it), and each replacement maps it
copy-on-write, so its tensors live in those pages and the file is gone once every
replacement has mapped it. Elsewhere, or where ``/dev/shm`` is missing or too small (a
container's 64 MB), the bytes go over MPI in messages of :data:`CHUNK_BYTES`, to every
replacement at once. Where the ranks' process group is NCCL's, a GPU's storages go from GPU to
GPU by NCCL's send instead, never through host memory. Rank 0 says how far it is
(``protocol.HEAL_PROGRESS_KEY``).
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from ipydist.protocol import (
    HEAL_FILE_PREFIX,
    HEAL_PROGRESS_KEY,
    HEAL_SHARED_MEMORY,
    HEAL_SHARED_MEMORY_VARIABLE,
)
from ipydist.rank import channel

#: The tensors' bytes travel in messages of this size at most: MPI counts in 32-bit ints in
#: its older calls, and a heal's progress is seen message by message.
CHUNK_BYTES = 64 << 20
#: How often rank 0 says how far the copy is.
PROGRESS_SECONDS = 0.5
#: Where a heal's shared-memory file goes, when it is there. ``--env
#: IPYDIST_HEAL_SHARED_MEMORY=DIR`` puts it elsewhere (a tmpfs of its own), ``=none`` sends
#: everything over MPI.
SHARED_MEMORY = HEAL_SHARED_MEMORY
SHARED_MEMORY_VARIABLE = HEAL_SHARED_MEMORY_VARIABLE
FILE_PREFIX = HEAL_FILE_PREFIX
#: Each storage starts at a multiple of this in the file (a page: any dtype's alignment).
ALIGN = 4096

_HOST, _ROUTE, _MAPPED, _DATA = 70, 73, 74, 72  # message tags


class _Progress:
    """Bytes delivered of how many, said at most every PROGRESS_SECONDS (and at the end)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.said = total, 0, 0.0
        channel.publish(HEAL_PROGRESS_KEY, (0, total))

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if time.monotonic() - self.said >= PROGRESS_SECONDS or self.done >= self.total:
            channel.publish(HEAL_PROGRESS_KEY, (self.done, self.total))
            self.said = time.monotonic()


def gpu_to_gpu(rt) -> bool:
    """Whether a GPU's storages travel from GPU to GPU: where the ranks' process group is
    NCCL's (gloo, which carries CUDA tensors where ranks share a GPU, has no send of them)."""
    import torch.distributed as dist

    return rt.backend == "nccl" and dist.is_initialized() and dist.get_backend() == "nccl"


def send(comm, views: list[memoryview], to: list[int], on_device=()) -> None:
    """On rank 0: every tensor's bytes (``views``, over the tensors' memory) to the ranks
    ``to``, each calling :func:`receive` at once; then the GPU storages ``on_device`` from
    GPU to GPU (:func:`gpu_to_gpu`)."""
    host = socket.gethostname()
    local = [rank for rank in to if comm.recv(source=rank, tag=_HOST) == host]
    total = sum(v.nbytes for v in views)
    progress = _Progress((total + sum(s.nbytes() for s in on_device)) * len(to))
    shared = _write_shared(views, progress, len(local)) if local and total else None
    for rank in to:
        comm.send(shared if rank in local else None, dest=rank, tag=_ROUTE)
    try:
        _send_over_mpi(comm, views, [r for r in to if shared is None or r not in local],
                       progress)
        if shared is not None:  # a replacement that could not map the file takes MPI
            failed = [rank for rank in local if not comm.recv(source=rank, tag=_MAPPED)]
            _send_over_mpi(comm, views, failed, progress)
    finally:
        if shared is not None:
            _remove(shared[0])
    _send_on_device(list(on_device), to, progress)


def receive(comm, root: int, sizes: list[int], device_sizes=()) -> tuple[list, list]:
    """On a replacement: the tensors' bytes from ``root``, one writable array per storage
    (of ``sizes`` bytes), which the loaded tensors then use; and the GPU storages of
    ``device_sizes`` bytes, on this rank's GPU."""
    comm.send(socket.gethostname(), dest=root, tag=_HOST)
    shared = comm.recv(source=root, tag=_ROUTE)
    if shared is None:
        arrays = _receive_over_mpi(comm, root, sizes)
    else:
        try:
            arrays = _map_shared(shared, sizes)
        except (OSError, ValueError):  # say so, and take the bytes over MPI instead
            comm.send(False, dest=root, tag=_MAPPED)
            arrays = _receive_over_mpi(comm, root, sizes)
        else:
            comm.send(True, dest=root, tag=_MAPPED)  # the file may go: the mapping keeps it
    return arrays, _receive_on_device(root, list(device_sizes))


def _send_on_device(storages: list, to: list[int], progress: _Progress) -> None:
    """GPU storages to the ranks ``to``, by NCCL's send, from GPU to GPU in pieces of
    :data:`CHUNK_BYTES` (what a pickle would have taken through host memory twice)."""
    if not storages:
        return
    import torch
    import torch.distributed as dist

    for rank in to:
        for untyped in storages:
            data = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped)
            for start, end in _chunks(data.numel()):
                dist.send(data[start:end], dst=rank)
                progress.add(end - start)


def _receive_on_device(root: int, sizes: list[int]) -> list:
    """GPU storages of ``sizes`` bytes from ``root`` (:func:`_send_on_device`), on this
    rank's own GPU."""
    if not sizes:
        return []
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    storages = []
    for size in sizes:
        data = torch.empty(size, dtype=torch.uint8, device=device)
        for start, end in _chunks(size):
            dist.recv(data[start:end], src=root)
        storages.append(data.untyped_storage())
    return storages


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each storage starts in the shared file, and the file's length."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def _write_shared(views: list[memoryview], progress: _Progress, readers: int):
    """The storages written into a new file in /dev/shm: (its path, the offsets); None where
    there is no room for them (then they go over MPI)."""
    offsets, length = _offsets([v.nbytes for v in views])
    folder = os.environ.get(SHARED_MEMORY_VARIABLE) or SHARED_MEMORY
    if folder == "none":
        return None
    try:
        free = os.statvfs(folder)
        if free.f_bavail * free.f_frsize < length + (64 << 20):
            return None
    except OSError:
        return None
    path = os.path.join(folder, f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, length)  # its whole length, mapped whole on the other side
        for view, offset in zip(views, offsets):
            for start in range(0, view.nbytes, CHUNK_BYTES):
                piece = view[start:start + CHUNK_BYTES]
                written = 0
                while written < piece.nbytes:
                    written += os.pwrite(fd, piece[written:], offset + start + written)
                progress.add(piece.nbytes * readers)
    except OSError:  # the file system filled up (its free space was shared)
        _remove(path)
        return None
    finally:
        os.close(fd)
    return path, offsets


def _map_shared(shared, sizes: list[int]) -> list:
    """The storages of the shared file, each an array over a copy-on-write mapping: no copy
    until a tensor is written, and then of the pages written only."""
    import mmap

    import numpy as np

    path, offsets = shared
    _, length = _offsets(sizes)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return [np.frombuffer(mapped, dtype=np.uint8, count=size, offset=offset) if size
            else np.empty(0, dtype=np.uint8) for size, offset in zip(sizes, offsets)]


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _chunks(nbytes: int):
    return ((start, min(start + CHUNK_BYTES, nbytes)) for start in range(0, nbytes, CHUNK_BYTES))


def _send_over_mpi(comm, views: list[memoryview], to: list[int], progress: _Progress) -> None:
    """Every tensor's bytes from where they lie (MPI reads the tensors' memory), to every
    rank of ``to`` at once, saying how far it is as messages complete."""
    from mpi4py import MPI

    pieces = [(rank, view[start:end]) for rank in to for view in views
              for start, end in _chunks(view.nbytes)]
    requests = [comm.Isend([piece, MPI.BYTE], dest=rank, tag=_DATA) for rank, piece in pieces]
    while (done := MPI.Request.Waitsome(requests)) is not None:
        progress.add(sum(pieces[i][1].nbytes for i in done))


def _receive_over_mpi(comm, root: int, sizes: list[int]) -> list:
    """The tensors' bytes straight into memory of their own (one array per storage)."""
    import numpy as np
    from mpi4py import MPI

    arrays = [np.empty(n, dtype=np.uint8) for n in sizes]
    requests = [comm.Irecv([array[start:end], MPI.BYTE], source=root, tag=_DATA)
                for array in arrays for start, end in _chunks(array.nbytes)]
    MPI.Request.Waitall(requests)
    return arrays
