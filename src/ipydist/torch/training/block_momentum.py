"""Block momentum: blockwise model-update filtering, BMUF (Chen & Huo, "Scalable training of
deep learning machines by incremental block training with intra-block parallel optimization
and blockwise model-update filtering", ICASSP 2016), as CNTK's
``block_momentum_distributed_learner`` does it.

Algorithm. Every rank holds the global model ``W`` and the block update ``D`` (both start as
the initial model and zero). A block:

1. each rank trains its own copy of the model on its own data for a block of steps of its
   local optimizer (``block_steps``, or CNTK's ``block_size`` in samples: see BlockMomentum),
   starting from the block's start ``S``, and reaches ``W_i``;
2. the ranks average their models, one allreduce per block: ``G = mean(W_i) - S``;
3. block momentum filters the update: ``D = block_momentum * D + block_learning_rate * G``;
4. ``W = W + D``; the next block starts from ``S = W + block_momentum * D`` (Nesterov-style
   look-ahead, the default) or ``S = W``.

``block_momentum`` defaults to ``1 - 1/size``, as CNTK sets it when it is not given. With
``block_momentum=0`` and ``block_learning_rate=1`` this is model averaging (local SGD), and with
blocks of one step too, synchronous SGD by averaging models. Communication falls by the block
length: one allreduce of the model per block.

As in ``ddp_comm_hooks``, the arithmetic is one function (:func:`filter_block`) on a small
state object (:class:`BlockState`); :func:`BlockMomentum` wraps an optimizer to run it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ipydist.torch._core import resync
from ipydist.torch._core.marks import waits_for_peers
from ipydist.torch._wire import transport
from ipydist.torch._wire.reduce_ops import Average
from ipydist.torch.horovod.basics import size
from ipydist.torch.horovod.collectives import allreduce_, broadcast_
from ipydist.torch.training import checkpoint
from ipydist.torch.training.optimizer import is_distributed
from ipydist.torch.training.wrapping import OptimizerMixinBase, wrap

#: Key of the block state in the optimizer's state dict.
_STATE_KEY = "ipydist_block"


@dataclass
class BlockState:
    """What BMUF keeps between blocks for the parameters of one dtype and device, flattened:
    the global model ``W``, the filtered block update ``D``, the block's start ``S``."""

    params: list[torch.Tensor]
    global_model: torch.Tensor
    update: torch.Tensor
    start: torch.Tensor

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> BlockState:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        return cls(params, flat, torch.zeros_like(flat), flat.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [self.global_model, self.update, self.start]

    def place(self, flat: torch.Tensor) -> None:
        """Copy the flat ``flat`` into the parameters."""
        sizes = [p.numel() for p in self.params]
        torch._foreach_copy_([p.data for p in self.params],
                             [v.view_as(p) for v, p in zip(flat.split(sizes), self.params)])

    def place_start(self) -> None:
        self.place(self.start)

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


def filter_block(state: BlockState, averaged: torch.Tensor, block_momentum: float,
                 block_learning_rate: float, nesterov: bool) -> None:
    """BMUF's update (steps 2-4 above) from ``averaged``, the mean of every rank's model at the
    end of the block (overwritten); leaves the next block's start in the parameters."""
    gain = averaged.sub_(state.start)  # G
    state.update.mul_(block_momentum).add_(gain, alpha=block_learning_rate)
    state.global_model.add_(state.update)
    if nesterov:
        torch.add(state.global_model, state.update, alpha=block_momentum, out=state.start)
    else:
        state.start.copy_(state.global_model)
    state.place_start()


class _BlockMomentumMixin(OptimizerMixinBase):
    """Methods mixed into a subclass of the wrapped optimizer's own class."""

    wrapper_name = "BlockMomentum"

    def _block_setup(self, block_steps, block_momentum, block_learning_rate, nesterov,
                     reset_sgd_momentum) -> None:
        if block_momentum is None:
            block_momentum = 1.0 - 1.0 / size()
        if not 0.0 <= block_momentum < 1.0:
            raise ValueError(f"block_momentum must be in [0, 1), not {block_momentum}")
        if not block_learning_rate > 0.0:
            raise ValueError(f"block_learning_rate must be above 0, not {block_learning_rate}")
        self._block_settings(block_steps, block_momentum, block_learning_rate, nesterov,
                             reset_sgd_momentum)
        for block in self._blocks:
            # every rank starts from rank 0's model, or the global models would differ for good
            broadcast_(block.global_model, root_rank=0)
            block.start.copy_(block.global_model)
            block.place_start()
        self._track()

    def _block_settings(self, block_steps, block_momentum, block_learning_rate, nesterov,
                        reset_sgd_momentum) -> None:
        """The settings, and a block state for each dtype and device of the parameters (no
        collective)."""
        #: Local optimizer steps per block (the same on every rank).
        self.block_steps = block_steps
        self.block_momentum = float(block_momentum)
        self.block_learning_rate = float(block_learning_rate)
        self.nesterov = bool(nesterov)
        self.reset_sgd_momentum = bool(reset_sgd_momentum)
        kinds: dict[tuple, list] = {}
        for group in self.param_groups:
            for p in group["params"]:
                kinds.setdefault((p.dtype, p.device), []).append(p)
        self._blocks = [BlockState.of(ps) for ps in kinds.values()]
        #: Local steps taken in this block (the same on every rank).
        self._steps_in_block = torch.zeros((), dtype=torch.int64)
        #: Bytes this rank has sent averaging models (as DistributedOptimizer's).
        self.bytes_sent = 0

    def _track(self) -> None:
        # Kept in step by the recovery: after an interrupt every rank goes on from rank 0's
        # block (its local model and optimizer state too, tracked with the optimizer).
        resync.track_optimizer(self)
        resync.track_tensors(
            [t for block in self._blocks for t in block.tensors()] + [self._steps_in_block])

    def __reduce__(self):
        """Pickled as what makes it: the local optimizer's class, state and parameter groups,
        the block settings and the block state (the same on every rank). Unpickling wraps a
        new optimizer again without a collective: how a replacement rank (``--elastic``) gets
        rank 0's BlockMomentum, in the block rank 0 is in (its local model is rank 0's)."""
        base = next(c for c in type(self).__mro__ if issubclass(c, torch.optim.Optimizer)
                    and not issubclass(c, _BlockMomentumMixin))
        state = {"defaults": self.defaults, "state": self.state,
                 "param_groups": self.param_groups}
        settings = (self.block_steps, self.block_momentum, self.block_learning_rate,
                    self.nesterov, self.reset_sgd_momentum)
        blocks = [block.tensors() for block in self._blocks]
        return _unpickle_block_momentum, (base, state, settings, blocks, self._steps_in_block,
                                          self.bytes_sent)

    def step(self, closure=None):
        """A local step; the last one of a block also averages and filters the models."""
        loss = super().step(closure)
        self._steps_in_block += 1
        if int(self._steps_in_block) >= self.block_steps:
            self.synchronize()
        return loss

    @waits_for_peers("average of models (BlockMomentum)")
    def synchronize(self) -> None:
        """End the block now (collective: every rank calls it): average the models, filter the
        update, and leave every rank at the next block's start. ``step()`` calls it every
        ``block_steps`` steps; call it yourself before evaluating or saving mid-block."""
        for block in self._blocks:
            averaged = block.flat_params()
            allreduce_(averaged, op=Average)
            self.bytes_sent += transport.bytes_sent(
                "allreduce", averaged.numel() * averaged.element_size(), size())
            filter_block(block, averaged, self.block_momentum, self.block_learning_rate,
                         self.nesterov)
        self._steps_in_block.zero_()
        if self.reset_sgd_momentum:  # CNTK's reset_sgd_momentum_after_aggregation
            for state in self.state.values():
                state.pop("momentum_buffer", None)

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The local optimizer's state, plus the block state (the same on every rank)."""
        state = super().state_dict()
        state[_STATE_KEY] = {"steps": int(self._steps_in_block),
                             "blocks": [[t.clone() for t in b.tensors()] for b in self._blocks]}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned; from a checkpoint written by
        ``hvd.save_checkpoint``, also this rank's own local model and optimizer state. Load
        the model first: within a block this puts the rank's own parameters back."""
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None)
        mine = checkpoint.this_ranks(state_dict.pop(checkpoint.RANK_STATE_KEY, None),
                                     "BlockMomentum's local models")
        if mine is not None:
            state_dict["state"] = mine["state"]
        super().load_state_dict(state_dict)
        if ours is not None:
            self._steps_in_block.fill_(ours["steps"])
            for block, saved in zip(self._blocks, ours["blocks"]):
                for t, value in zip(block.tensors(), saved):
                    t.copy_(value)
        if mine is not None and mine["params"] is not None:
            for block, flat in zip(self._blocks, mine["params"]):
                block.place(flat.to(block.start.device))

    def _ipydist_rank_state(self) -> dict:
        """What a checkpoint keeps per rank: the local optimizer state, and within a block the
        local model (at a block's end every rank's model is the block's start)."""
        mid_block = int(self._steps_in_block) > 0
        return {
            "state": super().state_dict()["state"],
            "params": [b.flat_params() for b in self._blocks] if mid_block else None,
        }


def _unpickle_block_momentum(base: type[torch.optim.Optimizer], state: dict, settings: tuple,
                             blocks: list, steps_in_block: torch.Tensor, bytes_sent: int):
    optimizer = base.__new__(base)  # type: ignore[call-overload]  # torch skipped: type[Any]
    optimizer.__setstate__(state)
    wrapped = wrap(optimizer, _BlockMomentumMixin)
    wrapped._block_settings(*settings)
    for block, saved in zip(wrapped._blocks, blocks):
        for t, value in zip(block.tensors(), saved):
            t.copy_(value)
    wrapped._steps_in_block.copy_(steps_in_block)
    wrapped.bytes_sent = bytes_sent
    wrapped._track()
    return wrapped


def block_steps_of(block_size: int | None, batch_size: int | None, block_steps: int | None,
                   world: int) -> int:
    """Local steps per block, from CNTK's ``block_size`` (samples per block, summed over the
    ranks) and ``batch_size`` (samples per rank per step), or from ``block_steps``.

    CNTK's learner ends a block once each worker has seen ``block_size // workers`` samples
    in it, so a block is that many samples rounded up to whole batches. Exactly one of the two
    ways must be given, and the samples way needs the batch size: a torch optimizer never sees
    the batch, and guessing it is how CNTK code moved over would get blocks a batch-size times
    too long."""
    if block_steps is not None:
        if block_size is not None or batch_size is not None:
            raise ValueError("give block_steps= (optimizer steps per block) or block_size= with "
                             "batch_size= (CNTK's samples per block), not both")
        if not isinstance(block_steps, int) or block_steps < 1:
            raise ValueError(f"block_steps must be a number of optimizer steps, 1 or more, not "
                             f"{block_steps!r}")
        return block_steps
    if block_size is None:
        raise ValueError("BlockMomentum needs the block length: block_steps=k (optimizer steps "
                         "per block) or block_size=n with batch_size=b (CNTK's: n samples per "
                         "block over all ranks, b samples per rank per step)")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size counts samples (CNTK's: per block, over all ranks), 1 or "
                         f"more, not {block_size!r}")
    if batch_size is None:
        raise ValueError(
            f"block_size={block_size} counts samples, as CNTK's block_size does: also give "
            f"batch_size= (samples per rank per step), or give block_steps= to count optimizer "
            f"steps instead")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be the samples per rank per step, 1 or more, not "
                         f"{batch_size!r}")
    per_rank = block_size // world
    if per_rank < 1:
        raise ValueError(f"block_size={block_size} samples is fewer than one per rank "
                         f"({world} ranks): CNTK calls this a sync period too small")
    return -(-per_rank // batch_size)


def BlockMomentum(  # noqa: N802 - a factory named like the class it returns, as Horovod's
    optimizer: torch.optim.Optimizer,
    block_size: int | None = None,
    block_momentum: float | None = None,
    block_learning_rate: float = 1.0,
    nesterov: bool = True,
    reset_sgd_momentum: bool = True,
    *,
    batch_size: int | None = None,
    block_steps: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap a local ``optimizer`` for block momentum training (BMUF, see the module docstring).

    Each rank trains on its own data and the models are averaged and filtered once per block.
    The block's length is given one of two ways: ``block_size`` in samples as CNTK's learner
    counts them (per block, summed over all ranks), with ``batch_size`` the samples per rank
    per step, so a block is ``ceil(block_size / size / batch_size)`` steps; or
    ``block_steps``, optimizer steps per block. ``block_momentum`` defaults to ``1 - 1/size``;
    0 gives model averaging (local SGD). ``reset_sgd_momentum`` clears SGD's momentum buffers
    after each block, as CNTK does by default. Collective: the model starts as rank 0's on every
    rank. The result is an instance of the optimizer's own class; do not also wrap it in
    DistributedOptimizer (BMUF averages models, not gradients).
    """
    if is_distributed(optimizer) or isinstance(optimizer, _BlockMomentumMixin):
        raise ValueError(
            "BlockMomentum wraps a plain local optimizer (e.g. torch.optim.SGD), not a "
            "DistributedOptimizer or another BlockMomentum: it averages models every "
            "block, not gradients every step")
    steps = block_steps_of(block_size, batch_size, block_steps, size())
    wrapped = wrap(optimizer, _BlockMomentumMixin)
    wrapped._block_setup(steps, block_momentum, block_learning_rate, nesterov,
                         reset_sgd_momentum)
    return wrapped
