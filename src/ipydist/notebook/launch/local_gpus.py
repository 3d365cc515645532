"""The GPUs of the notebook's host, counted before a launch without touching CUDA (the kernel
never does): the default number of ranks, and a check of ``--gpus``, ``--gpus-per-rank`` and
``--backend nccl`` that fails at once, once, rather than on every rank after mpiexec started
them all. Across hosts the ranks judge for themselves (``ipydist.rank.device``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from ipydist.errors import LaunchError
from ipydist.specs import format_gpus


def default_np(gpus: str | list[int] = "auto", gpus_per_rank: int = 1,
               inherited: str | None = None) -> int:
    """One rank per GPU the cluster may use (or per ``gpus_per_rank`` of them), else one per
    CPU core. The GPUs it may use: the ``--gpus`` list, else those of an inherited
    ``CUDA_VISIBLE_DEVICES`` (``inherited``: the kernel's own, which the ranks inherit),
    else the host's (``nvidia-smi``); ``--gpus none``: none."""
    return usable_gpus(gpus, inherited) // gpus_per_rank or os.cpu_count() or 1


def usable_gpus(gpus: str | list[int], inherited: str | None) -> int:
    """How many GPUs ranks started here may use (see :func:`default_np`)."""
    if gpus == "none":
        return 0
    if isinstance(gpus, list):
        return len(gpus)
    if inherited is not None:
        return _listed(inherited)
    return len(list_gpus())


def _listed(visible: str) -> int:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names."""
    return len([e for e in visible.split(",") if e.strip()])


def list_gpus() -> list[str]:
    """The ``GPU 0: ...`` lines of ``nvidia-smi -L`` (none without NVIDIA's driver).

    ``nvidia-smi`` is asked rather than torch so that the notebook kernel never touches CUDA.
    """
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
            return [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return []


def check_gpus_here(gpus: str | list[int], backend: str, np: int = 1,
                    gpus_per_rank: int = 1) -> None:
    """Before launching on this host alone: raise LaunchError if ``--gpus`` names a GPU this
    host lacks, ``--backend nccl`` has none, or ``--gpus-per-rank`` asks for more than there
    are, so the user hears it at once, once, rather than from every rank after mpiexec
    started them all. Only NVIDIA's GPUs are counted (``nvidia-smi``, else the
    ``/dev/nvidiaN`` devices); with ROCm's driver the ranks judge."""
    if os.path.exists("/dev/kfd"):
        return
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:  # the ranks inherit it, and --gpus counts within it
        count = _listed(inherited)
        found = (f"{count} GPU(s) in CUDA_VISIBLE_DEVICES ({inherited})" if count
                 else "no GPU (CUDA_VISIBLE_DEVICES is empty)")
    else:
        if shutil.which("nvidia-smi"):
            count = len(list_gpus())
        else:
            count = sum(1 for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n))
        found = f"{count} NVIDIA GPU(s)" if count else "no NVIDIA GPU"
    if isinstance(gpus, list) and max(gpus) >= count:
        missing = ",".join(str(i) for i in gpus if i >= count)
        raise LaunchError(
            f"--gpus {format_gpus(gpus)} names GPU {missing}, but this host has {found}. "
            "Use --gpus auto (GPUs when present) or --gpus none (CPU).")
    if gpus_per_rank > 1:
        usable = len(gpus) if isinstance(gpus, list) else 0 if gpus == "none" else count
        if np * gpus_per_rank > usable:
            given = (" of --gpus " + format_gpus(gpus)) if isinstance(gpus, list) else ""
            raise LaunchError(
                f"--np {np} with --gpus-per-rank {gpus_per_rank} needs {np * gpus_per_rank} "
                f"GPUs, but this host has {found}{given and f' ({usable}{given})'}"
                f"{' and --gpus none was given' if gpus == 'none' else ''}. Use a smaller "
                "--np or --gpus-per-rank.")
    if backend == "nccl" and (gpus == "none" or count == 0):
        why = "--gpus none was given" if gpus == "none" else f"this host has {found}"
        raise LaunchError(f"--backend nccl needs GPUs, but {why}. Use --backend gloo on CPU.")
