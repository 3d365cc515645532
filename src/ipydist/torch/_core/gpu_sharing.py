"""Ranks that share a GPU: how many share one, and how their CUDA tensors travel on the
machine's NCCL (its shared mode from 2.30, else gloo; ``--backend nccl``: each rank posing as
a host of its own). Decided on each rank after torch is imported, by a cluster's bootstrap
(``ipydist.rank.start.bootstrap``) or by :func:`~ipydist.torch._core.process_group.ensure` in
a plain script under mpiexec or torchrun. Pure logic, tested without GPUs."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ipydist.errors import LaunchError
from ipydist.protocol import MPI_BACKEND, NCCL_SHARED_MODE

#: How CUDA tensors travel between ranks that share a GPU (:func:`sharing_way`), in the
#: words of ``RankInfo.gpu_sharing``: NCCL's shared mode, NCCL with each rank posing as a host
#: of its own (``NCCL_HOSTID``: its socket transport, through host memory), gloo (through host
#: memory), or ipydist's MPI backend.
SHARING_WAYS = ("nccl", "nccl-hostid", "gloo", "mpi")


def ranks_per_gpu(local_size: int, gpu_count: int, own_gpus: bool = False) -> int:
    """How many of this host's ranks use one GPU at most (1: none shares; 0: no GPU)."""
    if gpu_count == 0:
        return 0
    return 1 if own_gpus else -(-local_size // gpu_count)


def nccl_version(found: int | tuple[int, ...]) -> tuple[int, int, int]:
    """NCCL's version as torch reports it (``torch.cuda.nccl.version()``: a tuple, or in
    older torch one number, ``major * 10000 + minor * 100 + patch`` since NCCL 2.9)."""
    if isinstance(found, int):
        return (found // 10000, found // 100 % 100, found % 100)
    major, minor, patch = (list(found) + [0, 0])[:3]
    return (int(major), int(minor), int(patch))


def sharing_way(backend: str, nccl_version: tuple[int, ...] | None) -> str:
    """How CUDA tensors travel between ranks that share a GPU, under ``--backend``.

    NCCL itself where its version can share (2.30's ``NCCL_MULTI_RANK_GPU_ENABLE``). On an
    older NCCL the default backend takes gloo, which carries CUDA tensors for allreduce,
    broadcast, allgather and reduce_scatter through host memory (faster than NCCL's socket
    route for small tensors, as fast for large ones: docs/gpus.md); ``--backend nccl`` asked
    for NCCL, so each rank poses as a host of its own to NCCL (``NCCL_HOSTID``), which then
    talks over its socket transport: NCCL's own behaviour (abort, watchdog) at socket speed.
    """
    if backend in ("gloo", "mpi"):
        return backend
    if nccl_version is not None and tuple(nccl_version[:2]) >= NCCL_SHARED_MODE:
        return "nccl"
    if backend == "nccl":
        if nccl_version is None:
            raise LaunchError(
                "--backend nccl: this torch has no NCCL (torch.cuda.nccl.version() fails). "
                "Install a CUDA build of torch, or leave --backend out (gloo).")
        return "nccl-hostid"
    return "gloo"


def plan_sharing(local_size: int, gpu_count: int, backend: str, own_gpus: bool,
                 nccl: int | tuple[int, ...] | None, host: str, local_rank: int,
                 environ: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """(how this rank's CUDA tensors travel when the host's ranks share its GPUs, what to set
    in its environment before NCCL makes a communicator): ("", {}) when each rank has a GPU
    of its own. ``nccl``: NCCL's version as torch reports it (None: a torch without NCCL)."""
    per_gpu = ranks_per_gpu(local_size, gpu_count, own_gpus)
    if per_gpu < 2:
        return "", {}
    way = sharing_way(backend, None if nccl is None else nccl_version(nccl))
    return way, sharing_env(way, per_gpu, host, local_rank, environ)


def sharing_env(way: str, per_gpu: int, host: str, local_rank: int,
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What to set in the environment before NCCL makes its communicators, for ranks that
    share GPUs ``way`` (up to ``per_gpu`` on one). A setting the user made (``--env``) is
    kept, except ``NCCL_HOSTID``, which must differ between the ranks of the host."""
    environ = os.environ if environ is None else environ
    wanted: dict[str, str] = {}
    if way == "nccl":
        wanted = {"NCCL_MULTI_RANK_GPU_ENABLE": "1",
                  "NCCL_NVLS_ENABLE": "0"}  # NVLink SHARP has no shared mode
        if per_gpu > 2:  # NCCL's shared mode plans for about 2 ranks a GPU: fewer channels
            wanted["NCCL_MAX_CTAS"] = str(max(1, 8 // per_gpu))
        wanted = {k: v for k, v in wanted.items() if k not in environ}
    elif way == "nccl-hostid":
        wanted = {"NCCL_HOSTID": f"{host}.ipydist-local-rank-{local_rank}"}
    return wanted


def resolve_backend(backend: str, device_index: int | None, way: str = "") -> str:
    """nccl when the rank has a GPU, gloo otherwise, unless ``--backend`` says which (``mpi``:
    ipydist's backend over mpi4py, ``ipydist.torch._mpi.backend``); gloo for ranks that share
    a GPU where NCCL cannot (``way``: :func:`sharing_way`)."""
    if backend == "mpi":
        return MPI_BACKEND
    if backend in ("nccl", "gloo"):
        return backend
    return "nccl" if device_index is not None and way in ("", "nccl") else "gloo"
