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
    fixed port is needed. Anything else goes to torch as asked.
    """
    global _reuse_announced
    rt = topology.get()
    original = inspect.signature(process_group.original_init_process_group)
    asked = original.bind_partial(*args, **kwargs).arguments
    ours = rt is not None and (
        int(asked.get("world_size", -1)) in (-1, rt.size)
        and int(asked.get("rank", -1)) in (-1, rt.rank)
        and asked.get("init_method") in (None, "env://")
        and asked.get("store") is None
    )
    backend = _plain_backend(asked.get("backend"), rt)
    if ours and backend is not None:
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
    result = process_group.original_init_process_group(*args, **kwargs)
    retired.keep(dist.group.WORLD)
    return result


def _plain_backend(asked, rt: topology.Runtime | None) -> str | None:
    """"gloo", "nccl" or "mpi4py" for a backend ipydist can make itself; None for anything
    else."""
    if rt is None:
        return None
    if asked is None:
        return rt.backend
    name = str(asked).lower()
    if name in ("gloo", "nccl", MPI_BACKEND):
        return name
    if name == "mpi" and not dist.is_mpi_available():  # torch's own: ipydist's stands in
        return MPI_BACKEND
    if name == "cpu:gloo,cuda:nccl" and rt.device_index is not None:
        return "nccl"
    return None


#: Every DistributedDataParallel model made on this rank (see :func:`track_ddp_models`).
_ddp_models: weakref.WeakSet = weakref.WeakSet()


def track_ddp_models() -> None:
    """Remember each DistributedDataParallel model made from now on, weakly: after a rebuild
    the notebook asks the user to wrap one again, and only when one exists (looking through
    every object instead takes a second on a busy machine)."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    if getattr(init, "_ipydist_tracks", False):
        return

    @functools.wraps(init)
    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _ddp_models.add(self)

    tracking_init._ipydist_tracks = True
    DistributedDataParallel.__init__ = tracking_init


def has_ddp_model() -> bool:
    return len(_ddp_models) > 0


def install_reuse_shim() -> None:
    """Route user calls of ``init_process_group`` through :func:`_reusing_init_process_group`."""
    dist.init_process_group = _reusing_init_process_group
