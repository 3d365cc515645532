"""This rank's device, backend and thread count: decided on each rank, which alone sees its
host's GPUs and knows how many ranks share the host. Pure logic, tested without GPUs."""

from __future__ import annotations

from ipydist.errors import LaunchError
from ipydist.protocol import MPI_BACKEND
from ipydist.specs import format_gpus


def plan_device(
    gpus: str | list[int], local_rank: int, local_size: int, device_count: int, backend: str
) -> int | None:
    """The CUDA device index this rank uses (None: CPU), or a LaunchError saying what to fix.

    ``device_count`` counts the devices visible after ``CUDA_VISIBLE_DEVICES`` was set to the
    ``--gpus`` list, so with a list the index is simply the local rank: that keeps
    ``torch.cuda.set_device(hvd.local_rank())`` in Horovod code pointing at the same GPU.
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
    if local_size > wanted and backend in ("nccl", "auto"):
        raise LaunchError(
            f"{local_size} ranks on this host but only {wanted} GPU(s): NCCL needs one GPU per "
            "rank. Use --np with at most one rank per GPU, or --backend gloo to share GPUs."
        )
    return local_rank % wanted


def resolve_backend(backend: str, device_index: int | None) -> str:
    """nccl when the rank has a GPU, gloo otherwise, unless ``--backend`` says which (``mpi``:
    ipydist's backend over mpi4py, ``ipydist.torch._mpi.backend``)."""
    if backend == "mpi":
        return MPI_BACKEND
    if backend in ("nccl", "gloo"):
        return backend
    return "nccl" if device_index is not None else "gloo"


def threads_per_rank(cores: int, local_size: int) -> int:
    """torch threads per rank so that the ranks on one host do not oversubscribe its cores."""
    return max(1, cores // max(1, local_size))
