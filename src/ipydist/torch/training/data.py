"""Each rank's part of a data set, and the learning rate that goes with more ranks.

``DataLoader(ds, batch_size=b, sampler=hvd.shard(ds))`` gives every rank its own disjoint part
of ``ds``, the same number of samples on every rank, so ranks step through their batches (and
the collectives inside each step) in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler

from ipydist.torch.horovod import basics


class ShardSampler(Sampler[int]):
    """This rank's indices of a data set: every ``num_replicas``-th one of a permutation.

    Rank ``r`` takes positions ``r, r + n, r + 2n, ...`` of ``range(len(dataset))``, shuffled
    by a permutation seeded with ``seed + epoch`` (the same on every rank, so the parts are
    disjoint), as ``torch.utils.data.DistributedSampler`` does. Unless ``drop_last``, the
    permutation is padded by repeating its first indices so that every rank gets the same count;
    with ``drop_last`` the tail that does not divide evenly is left out instead. Use it as
    ``DataLoader(ds, batch_size=b, sampler=hvd.shard(ds))`` and call ``set_epoch(epoch)`` each
    epoch; ``num_replicas`` and ``rank`` default to ``size()`` and ``rank()``.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if num_replicas is None:
            num_replicas = basics.size()
        if rank is None:
            rank = basics.rank()
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank}, but ranks are 0..{num_replicas - 1}")
        try:
            len(dataset)  # a length is what a shard needs
        except TypeError:
            raise TypeError(
                f"shard needs a data set with a length (len()), not {type(dataset).__name__}; "
                "an IterableDataset must split itself between ranks"
            ) from None
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.set_place(rank, num_replicas)

    def set_place(self, rank: int, num_replicas: int) -> None:
        """This rank's part among ``num_replicas`` (also after the world changed size)."""
        length = len(self.dataset)
        self.rank, self.num_replicas = rank, num_replicas
        if self.drop_last:
            self.num_samples = length // num_replicas
        else:
            self.num_samples = math.ceil(length / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call it at the start of each epoch, on every rank)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif indices:
            missing = self.total_size - len(indices)
            indices += (indices * math.ceil(missing / len(indices)))[:missing]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


#: ``hvd.shard(dataset, shuffle=True, seed=0, drop_last=False)``: the name users type.
shard = ShardSampler


def scale_lr(lr: float) -> float:
    """``lr * size()``: the learning rate for ``size()`` ranks, given the one for one rank.

    Each step averages gradients over ``size()`` ranks, so the effective batch is ``size()``
    times larger; the linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD:
    Training ImageNet in 1 Hour", arXiv:1706.02677) multiplies the learning rate by the same
    factor to keep training comparable. That paper also warms the rate up over the first epochs
    when the factor is large.
    """
    return lr * basics.size()
