"""What a ``DistributedOptimizer`` keeps in a checkpoint: the wrapped optimizer's state, the
steps taken (the warm starts count them) and, per rank, what a compression's own exchange keeps
(1-bit's residuals, PowerSGD's error feedback), under that exchange's name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipydist.torch.training import checkpoint
from ipydist.torch.training.gradients.exchanges import kept_exchange
from ipydist.torch.training.wrapping import OptimizerMixinBase

if TYPE_CHECKING:
    import torch

    from ipydist.torch._wire.compression import AnyCompressor
    from ipydist.torch.training.gradients.buckets import Bucket

#: Key of ipydist's own entries in the optimizer's state dict.
_STATE_KEY = "ipydist"


class CheckpointMixin(OptimizerMixinBase):
    """``DistributedOptimizer``'s state methods (mixed in before the wrapped class's own)."""

    if TYPE_CHECKING:  # set by DistributedOptimizer's setup
        _steps: torch.Tensor
        _buckets: list[Bucket]
        _compression: AnyCompressor

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, plus the steps taken (for ``distributed_after``)."""
        state = super().state_dict()
        state[_STATE_KEY] = {"steps": int(self._steps)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned; from a checkpoint written by
        ``hvd.save_checkpoint``, also this rank's own state of the compression's exchange."""
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None) or {}
        per_rank = state_dict.pop(checkpoint.RANK_STATE_KEY, None)
        super().load_state_dict(state_dict)
        self._steps.fill_(int(ours.get("steps", 0)))
        exchange = kept_exchange(self._compression)
        mine = checkpoint.this_ranks(per_rank, "DistributedOptimizer's error feedback")
        saved = ((mine or {}).get(exchange.name) if exchange is not None else None) or [
            None] * len(self._buckets)
        for bucket, state in zip(self._buckets, saved):  # none saved: start afresh
            bucket.kept = None
            if bucket.correction is not None:
                bucket.correction.load(None)
            if state is not None:
                bucket.kept_exchange(self._compression).load(state)

    def _ipydist_rank_state(self) -> dict | None:
        """What differs between ranks and a checkpoint must keep per rank: what the
        compression's exchange keeps (1-bit's residuals and the velocity of a momentum
        correction, PowerSGD's error feedback), under the exchange's name."""
        kept = [b.kept for b in self._buckets]
        if all(k is None for k in kept):
            return None
        name = next(k for k in kept if k is not None).name
        return {name: [None if k is None else k.state() for k in kept]}
