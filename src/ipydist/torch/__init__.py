"""The API used inside ``%%everyrank`` cells, with Horovod's names.

``import ipydist.torch as hvd`` lets Horovod PyTorch code run as it is::

    hvd.init()
    torch.manual_seed(hvd.rank())
    total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)   # == hvd.size()
"""

from ipydist.torch.block_momentum import BlockMomentum
from ipydist.torch.checkpoint import load_checkpoint, save_checkpoint
from ipydist.torch.collectives import (
    Average,
    Max,
    Min,
    ReduceOp,
    Sum,
    allgather,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    cross_rank,
    cross_size,
    device,
    init,
    local_rank,
    local_size,
    rank,
    size,
)
from ipydist.torch.compression import Compression
from ipydist.torch.data import ShardSampler, scale_lr, shard
from ipydist.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ipydist.torch.metrics import log
from ipydist.torch.mpi_backend import register as _register_mpi_backend
from ipydist.torch.optimizer import DistributedOptimizer

__all__ = [
    "Average", "BlockMomentum", "Compression", "DistributedOptimizer", "Max", "Min", "ReduceOp",
    "ShardSampler",
    "Sum", "allgather", "allgather_object", "allreduce", "allreduce_", "barrier",
    "broadcast", "broadcast_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "cross_rank", "cross_size", "device", "init", "load_checkpoint",
    "local_rank", "local_size", "log",
    "rank", "save_checkpoint", "scale_lr", "shard", "size",
]

_register_mpi_backend()  # backend="mpi4py" (--backend mpi) for init_process_group and new_group
