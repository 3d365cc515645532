"""This rank's device, backend and thread count: decided on each rank, which alone sees its
host's GPUs and knows how many ranks share the host. Pure logic, tested without GPUs."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import overload

from ipydist.errors import LaunchError
from ipydist.specs import format_gpus


@overload
def entries(visible: str) -> list[str]: ...
@overload
def entries(visible: str | None) -> list[str] | None: ...
def entries(visible: str | None) -> list[str] | None:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names (indices, UUIDs or MIG names, kept
    as written); None when it is not set."""
    if visible is None:
        return None
    return [e.strip() for e in visible.split(",") if e.strip()]


def visible_devices(gpus: str | list[int], inherited: str | None) -> str | None:
    """What to set ``CUDA_VISIBLE_DEVICES`` to before torch touches CUDA (None: leave it).

    ``--gpus none`` hides every GPU (an empty value), so that user code cannot take one the
    cluster was not given. A ``--gpus`` list counts within what the rank inherited (a Slurm
    allocation, a scheduler's or a user's ``CUDA_VISIBLE_DEVICES``): ``--gpus 1,3`` under
    ``4,5,6,7`` is ``5,7``; absolute indices would escape the allocation. Without one, the
    list is the host's GPUs (in PCI bus order: see :data:`DEVICE_ORDER`).
    """
    if gpus == "none":
        return ""
    if gpus == "auto":
        return None
    given = entries(inherited)
    if given is None:
        return format_gpus(gpus)
    assert isinstance(gpus, list)  # "auto" and "none" are its only words
    outside = [i for i in gpus if i >= len(given)]
    if outside:
        have = (f"GPUs 0-{len(given) - 1} ({inherited})" if given
                else "no GPU (CUDA_VISIBLE_DEVICES is empty)")
        raise LaunchError(
            f"--gpus {format_gpus(gpus)} names GPU {','.join(map(str, outside))}, but this "
            f"rank was given {have}: --gpus counts within CUDA_VISIBLE_DEVICES. Use --gpus auto "
            "to use what was given.")
    return ",".join(given[i] for i in gpus)


def visible_for_rank(gpus: str | list[int], inherited: str | None, per_rank: int,
                     local_rank: int, local_size: int, own_gpus: bool, host_count: int
                     ) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a rank that sees ``per_rank`` GPUs (``--gpus-per-rank``),
    or what :func:`visible_devices` says when it is 1.

    The GPUs the ranks of this host may use (the ``--gpus`` list within what they inherited,
    else all ``host_count`` of the host's) are dealt out in local-rank order: with 2 per rank,
    local rank 0 sees the first two, local rank 1 the next two. Each rank then counts its
    own GPUs from 0 (``cuda:0`` is its first), for a model split across them, while
    ``hvd.local_rank()`` still numbers the ranks of the host. A rank that was given GPUs of
    its own (``own_gpus``: Slurm's ``--gpus-per-task``) keeps its own.
    """
    if per_rank == 1:
        return visible_devices(gpus, inherited)
    if gpus == "none":
        raise LaunchError(f"--gpus-per-rank {per_rank} needs GPUs, but --gpus none was given.")
    listed = visible_devices(gpus, inherited)
    if listed is None:  # --gpus auto: what the rank inherited, else every GPU of the host
        listed = inherited
    usable = entries(listed) if listed is not None else [str(i) for i in range(host_count)]
    if own_gpus:
        first, needed = 0, per_rank
    else:
        first, needed = local_rank * per_rank, local_size * per_rank
    if len(usable) < needed:
        ranks = "this rank was" if own_gpus else f"the {local_size} ranks on this host were"
        raise LaunchError(
            f"--gpus-per-rank {per_rank} needs {needed} GPU(s), but {ranks} given "
            f"{len(usable)}{f' ({listed})' if listed else ''}. Use fewer ranks per host "
            "(--np, or --hosts nodeA:2) or a smaller --gpus-per-rank.")
    return ",".join(usable[first:first + per_rank])


def host_gpu_count() -> int:
    """The NVIDIA GPUs of this host, counted without touching CUDA (once CUDA starts in a
    process, ``CUDA_VISIBLE_DEVICES`` no longer changes what it sees): its ``/dev/nvidiaN``."""
    try:
        return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return 0


#: ``CUDA_DEVICE_ORDER`` on the ranks (unless set): CUDA's own order is fastest first, while
#: ``nvidia-smi``, Slurm and ``--gpus`` number GPUs by PCI bus.
DEVICE_ORDER = "PCI_BUS_ID"


def plan_device(
    gpus: str | list[int], local_rank: int, local_size: int, device_count: int, backend: str,
    own_gpus: bool = False,
) -> int | None:
    """The CUDA device index this rank uses (None: CPU), or a LaunchError saying what to fix.

    ``device_count`` counts the devices visible after ``CUDA_VISIBLE_DEVICES`` was set (see
    :func:`visible_devices`), so with a list the index is simply the local rank: that keeps
    ``torch.cuda.set_device(hvd.local_rank())`` in Horovod code pointing at the same GPU.
    ``own_gpus``: each rank on this host was given GPUs of its own (Slurm's
    ``--gpus-per-task``, a ``CUDA_VISIBLE_DEVICES`` per rank): the rank then uses its first,
    and one visible GPU per rank is what NCCL needs, not too few.
    """
    if gpus == "none":
        if backend == "nccl":
            raise LaunchError("--backend nccl needs GPUs, but --gpus none was given.")
        return None
    if gpus == "auto":
        if device_count == 0:
            if backend == "nccl":
                raise LaunchError(
                    "--backend nccl needs GPUs, but this host has no CUDA GPU visible to torch."
                )
            return None
        wanted = device_count
    else:
        if device_count < len(gpus):
            raise LaunchError(
                f"--gpus {format_gpus(gpus)} asks for {len(gpus)} GPU(s), but this host has "
                f"{device_count} CUDA GPU(s) visible to torch. Use --gpus auto (GPUs when "
                "present) or --gpus none (CPU)."
            )
        wanted = len(gpus)
    if own_gpus:
        return 0
    return local_rank % wanted  # more ranks than GPUs: dealt round-robin (see sharing_way)


def own_gpus(visible_on_host: list[str | None]) -> bool:
    """Whether the ranks of one host (their inherited ``CUDA_VISIBLE_DEVICES``, in order)
    were each given GPUs of their own: set on every rank, none empty, no device named by two."""
    lists = [entries(v) for v in visible_on_host]
    if len(lists) < 2 or any(not devices for devices in lists):
        return False
    named = [d for devices in lists for d in devices or ()]  # none is None: see above
    return len(named) == len(set(named))


def agree_backend(wishes: Sequence[str], kept: Sequence[str | None]) -> str:
    """The one backend of every rank's group, from what each rank would use (``wishes``, in
    rank order) and the backend each kept from before (``kept``: a survivor's in a heal, None
    for a rank starting). A survivor's group stays what it is; otherwise gloo wins over the
    default's NCCL, for a host without GPUs (or whose ranks share one over gloo) cannot join
    an NCCL group."""
    for backend in kept:
        if backend is not None:
            return backend
    if len(set(wishes)) == 1:
        return wishes[0]
    return "gloo" if "gloo" in wishes else wishes[0]


def threads_per_rank(cores: int, local_size: int, usable: int | None = None) -> int:
    """torch threads per rank so that the ranks on one host do not oversubscribe its cores,
    and no more than the cores the rank may run on (``usable``: its CPU affinity, where a
    launcher bound it: Slurm's ``--cpus-per-task``, an ``--mpi-args=--bind-to core``). More
    threads than cores make torch's threads wait for each other: 600x slower steps."""
    threads = max(1, cores // max(1, local_size))
    return threads if usable is None else max(1, min(threads, usable))
