"""Horovod's basics: ``init()``, where this rank stands (``rank() size() local_rank()
local_size() cross_rank() cross_size() device()``), whether ``init()`` has run, ``shutdown()``,
and the questions about the build and the running job: what is built in, what is in use.

``init()`` and the questions about this rank make sure the default process group exists first
(user code may have destroyed it in an earlier cell), so they work in any cell.

"Built" answers for this torch and mpi4py (Horovod answers for how it was compiled): MPI is
built when mpi4py imports, NCCL when torch has it (as Horovod's version code, e.g. 21803 for
2.18.3), gloo when torch.distributed has it. "Enabled" answers for this job: MPI when mpiexec
or srun started the ranks and ipydist's collectives use it, gloo when they use the process
group's gloo.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from ipydist.error_base import IpydistError
from ipydist.torch._core import events, process_group, topology
from ipydist.torch.horovod.process_sets import add_at_init


class HorovodInternalError(IpydistError, RuntimeError):
    """A collective failed inside the communication layer (Horovod's name): a peer died or a
    release ended the operation. Catch it where Horovod code catches Horovod's."""


def init(comm=None, process_sets=None) -> None:
    """Make sure this rank has its process group (idempotent; collective the first time),
    and add Horovod's static ``process_sets`` (a list of ProcessSets or of lists of ranks)
    not added yet. ``comm``, Horovod's MPI communicator argument, may only be the world: the
    ranks are those mpiexec started (process sets give collectives on fewer)."""
    rt = process_group.ensure()
    events.start_from_environment(os.environ)
    if comm is not None and (not hasattr(comm, "Get_size") or comm.Get_size() != rt.size):
        raise ValueError("hvd.init(comm=...) takes only the world communicator here: use "
                         "process_sets=[...] (or hvd.add_process_set) for collectives among "
                         "fewer ranks")
    if process_sets:
        add_at_init(process_sets)


def rank() -> int:
    """This rank's index in the world, 0..size()-1."""
    return process_group.ensure().rank


def size() -> int:
    """Number of ranks."""
    return process_group.ensure().size


def local_rank() -> int:
    """This rank's index among the ranks on its host."""
    return process_group.ensure().local_rank


def local_size() -> int:
    """Number of ranks on this rank's host."""
    return process_group.ensure().local_size


def cross_rank() -> int:
    """This rank's index among the ranks that have its local rank: the index of its host when
    every host runs the same number of ranks (Horovod's name)."""
    return process_group.ensure().cross_rank


def cross_size() -> int:
    """How many ranks have this rank's local rank: the number of hosts, when every host runs
    the same number of ranks (Horovod's name)."""
    return process_group.ensure().cross_size


def device() -> torch.device:
    """The device this rank computes on: its pinned GPU, or the CPU."""
    return process_group.ensure().device


def is_initialized() -> bool:
    """Whether ``init()`` has run (and ``shutdown()`` has not since)."""
    return topology.get() is not None and dist.is_initialized()


def shutdown() -> None:
    """End the default process group (Horovod's ``shutdown``); ``init()`` or any collective
    makes it again. The ranks, MPI and the notebook connection stay."""
    if dist.is_initialized():
        dist.destroy_process_group()


@functools.cache
def mpi_built() -> bool:
    """Whether MPI can be used here (mpi4py imports)."""
    try:
        import mpi4py.MPI  # noqa: F401
    except ImportError:
        return False
    return True


def gloo_built() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> int:
    """NCCL's version as Horovod's code (major * 10000 + minor * 100 + patch), or 0."""
    if not (dist.is_available() and dist.is_nccl_available()):
        return 0
    return nccl_code(torch.cuda.nccl.version())


def nccl_code(version) -> int:
    """Horovod's number for an NCCL version as torch gives it: ``(2, 21, 5)``, or with a
    suffix, ``(2, 21, 5, "+cuda12.4")`` (the suffix is not part of the number)."""
    major, minor, patch = (int(str(part).split("+")[0] or 0) for part in tuple(version)[:3])
    return major * 10000 + minor * 100 + patch


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def mpi_enabled() -> bool:
    """Whether ipydist's collectives on CPU tensors go over MPI in this job."""
    rt = topology.get()
    return rt is not None and rt.transport == "mpi" and rt.data_comm is not None


def gloo_enabled() -> bool:
    """Whether gloo serves the process group's CPU tensors (which carry what MPI does not):
    a gloo cluster's, and an NCCL cluster's (``cpu:gloo,cuda:nccl``)."""
    rt = topology.get()
    return rt is not None and "gloo" in process_group.torch_backend(rt.backend)


def mpi_threads_supported() -> bool:
    """Whether MPI was started with MPI_THREAD_MULTIPLE."""
    if not mpi_built():
        return False
    from mpi4py import MPI

    return MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return process_group.ensure().homogeneous
