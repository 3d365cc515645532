"""What ipydist puts around torch.distributed calls that user code makes itself.

``init_process_group`` keeps or remakes ipydist's group when the call asks for what ipydist
provides (code written for torchrun calls it), and DistributedDataParallel models are counted,
so that the notebook asks to wrap one again after a rebuild only when one exists.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ipydist.protocol import MPI_BACKEND
from ipydist.torch._core import process_group, retired, topology

_reuse_announced = False


@functools.wraps(process_group.original_init_process_group)
def _reusing_init_process_group(*args, **kwargs):
    """``torch.distributed.init_process_group`` that keeps or remakes ipydist's group.

    Code written for ``torchrun`` or the DDP tutorial calls ``init_process_group`` itself, often
    after an earlier ``destroy_process_group()``. When the call asks for what ipydist provides
    (its rank and world size, any backend, no ``init_method`` or ``store`` of its own), it keeps
    the group ``%dist_start`` made, or makes a new one through ipydist's own rendezvous, so no
    fixed port is needed. A call with a rendezvous of its own goes to torch as asked; when it
    is for ipydist's world, ipydist then takes the group over (``process_group.adopt``), so
    that a release breaks it and the recovery rebuilds it like its own.
    """
    global _reuse_announced
    rt = topology.get()
    original = inspect.signature(process_group.original_init_process_group)
    asked = original.bind_partial(*args, **kwargs).arguments
    same_world = rt is not None and (
        int(asked.get("world_size", -1)) in (-1, rt.size)
        and int(asked.get("rank", -1)) in (-1, rt.rank)
    )
    ours = same_world and asked.get("init_method") in (None, "env://") and (
        asked.get("store") is None)
    if ours:
        assert rt is not None  # same_world
        backend = plain_backend(asked.get("backend"), rt)
        if process_group.owns_default(rt) and backend == rt.backend:
            if not _reuse_announced and rt.rank == 0:
                print(
                    f"ipydist: init_process_group() keeps the {rt.backend} group of "
                    f"{rt.size} ranks that %dist_start made.",
                    file=sys.stderr,
                )
            _reuse_announced = True
            return None
        if dist.is_initialized():
            dist.destroy_process_group()
        process_group.make(rt, backend)
        return None
    if process_group.owns_default(rt):
        dist.destroy_process_group()
    before = process_group.connections()
    result = process_group.original_init_process_group(*args, **kwargs)
    if same_world:
        assert rt is not None  # same_world
        process_group.adopt(rt, before)
    else:
        retired.keep(dist.group.WORLD)
    return result


def plain_backend(asked, rt: topology.Runtime) -> str:
    """The backend ipydist makes for a call of ``init_process_group(backend=asked)``.

    ``None``: the cluster's own. ``mpi`` (torch's, not built into its wheels): ipydist's
    backend over mpi4py stands in. ``cpu:gloo,cuda:nccl``, PyTorch's form for mixed work: what
    ipydist's ``nccl`` is on a rank with a GPU, gloo on one without (NCCL could not be made
    there). NCCL asked of ranks that share a GPU over gloo: the cluster's gloo, which NCCL
    older than 2.30 cannot replace there. Any other name or ``device:backend`` list is given
    to torch as it is, through ipydist's rendezvous.
    """
    if asked is None:
        return rt.backend
    name = str(asked).strip().lower()
    if name == "mpi" and not dist.is_mpi_available():
        return MPI_BACKEND
    nccl = name.replace(" ", "") in ("nccl", process_group.NCCL_WITH_CPU)
    if nccl and rt.gpu_sharing in ("gloo", "mpi"):
        return rt.backend  # ranks sharing a GPU where NCCL cannot ("Duplicate GPU detected")
    if name.replace(" ", "") == process_group.NCCL_WITH_CPU:
        return "nccl" if rt.device_index is not None else "gloo"
    return name


_set_device_announced = False


def install_shared_gpu_shim() -> None:
    """``torch.cuda.set_device(hvd.local_rank())``, Horovod's way to pin a rank's GPU, on a
    host whose ranks share its GPUs: local rank 2 of 4 ranks on 1 GPU names a GPU that is not
    there, so the call pins the GPU the rank was dealt instead (and says so once). Any other
    index goes to torch as given."""
    original = torch.cuda.set_device

    @functools.wraps(original)
    def set_device(device) -> None:
        global _set_device_announced
        rt = topology.get()
        index = device.index if isinstance(device, torch.device) else device
        if isinstance(index, str):
            index = torch.device(index).index
        if (rt is not None and rt.gpu_sharing and rt.device_index is not None
                and index == rt.local_rank and index >= torch.cuda.device_count()):
            if not _set_device_announced:
                print(f"ipydist: torch.cuda.set_device({index}) on rank {rt.rank}: "
                      f"{rt.local_size} ranks share {torch.cuda.device_count()} GPU(s) on "
                      f"this host, so it pins cuda:{rt.device_index}, the GPU this rank "
                      "was dealt (hvd.device() names it).", file=sys.stderr)
                _set_device_announced = True
            index = rt.device_index
        return original(index if index is not None else device)

    torch.cuda.set_device = set_device


#: Every DistributedDataParallel model made on this rank (see :func:`track_ddp_models`), weakly,
#: each with whether it was made over the default group (which it can follow when that is made
#: again: :mod:`ipydist.torch._core.group_holders`).
_ddp_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def track_ddp_models() -> None:
    """Remember each DistributedDataParallel model made from now on, weakly: after a heal or a
    rebuild of the group it follows the new group (looking through every object for them
    instead takes a second on a busy machine)."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "_ipydist_tracks", False):
        return

    @functools.wraps(init)
    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        track(self, getattr(self, "device_mesh", None) is None
              and self.process_group is dist.group.WORLD)

    tracking_init._ipydist_tracks = True  # type: ignore[attr-defined]  # a mark, read by getattr
    DistributedDataParallel.__init__ = tracking_init


def track(ddp, on_default: bool) -> None:
    _ddp_models[ddp] = on_default


def ddp_models() -> list[tuple[Any, bool]]:
    """The DDP models alive on this rank, each with whether it was made over the default group."""
    return list(_ddp_models.items())


def has_ddp_model() -> bool:
    return len(_ddp_models) > 0


def install_reuse_shim() -> None:
    """Route user calls of ``init_process_group`` through :func:`_reusing_init_process_group`."""
    dist.init_process_group = _reusing_init_process_group
