"""The API used inside ``%%everyrank`` cells, with Horovod's names.

This module only re-exports. The code lives in sub-packages by concern, imports running one way
(each may import those listed before it, never after): ``_core`` (the rank's runtime: topology,
process group, store, waits, resync), ``_wire`` (how one collective call moves: the check,
transports, handles, reductions, compression), ``_mpi`` (``--backend mpi``), ``horovod``
(Horovod's API), ``training`` (DistributedOptimizer, 1-bit SGD, block momentum, checkpoints,
data, metrics). The rank side (:mod:`ipydist.rank`) imports torch/, never the other way round.

``import ipydist.torch as hvd`` lets Horovod PyTorch code run as it is::

    hvd.init()
    torch.manual_seed(hvd.rank())
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)   # == hvd.size()
"""

from ipydist.torch._mpi.backend import register as _register_mpi_backend
from ipydist.torch._wire import call_check as call_check  # .set_enabled(False): check off
from ipydist.torch._wire.compression import Compression
from ipydist.torch._wire.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ipydist.torch.horovod import elastic
from ipydist.torch.horovod.async_ops import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from ipydist.torch.horovod.basics import (
    HorovodInternalError,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    device,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ipydist.torch.horovod.collectives import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    reducescatter,
)
from ipydist.torch.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ipydist.torch.horovod.join import join
from ipydist.torch.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from ipydist.torch.horovod.sync_batch_norm import SyncBatchNorm
from ipydist.torch.horovod.timeline import start_timeline, stop_timeline
from ipydist.torch.training.block_momentum import BlockMomentum
from ipydist.torch.training.checkpoint import load_checkpoint, save_checkpoint
from ipydist.torch.training.data import ShardSampler, scale_lr, shard
from ipydist.torch.training.metrics import log
from ipydist.torch.training.optimizer import DistributedOptimizer

__all__ = [
    "Adasum", "add_process_set", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "Average", "barrier", "BlockMomentum", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "Compression", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "device", "DistributedOptimizer", "elastic", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "HorovodInternalError", "init", "is_homogeneous", "is_initialized", "join",
    "load_checkpoint", "local_rank", "local_size", "log", "Max", "Min", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "ProcessSet", "Product",
    "rank", "ReduceOp", "reducescatter", "reducescatter_async", "remove_process_set",
    "rocm_built", "save_checkpoint", "scale_lr", "shard", "ShardSampler", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "Sum", "SyncBatchNorm",
    "synchronize",
]

_register_mpi_backend()  # backend="mpi4py" (--backend mpi) for init_process_group and new_group
