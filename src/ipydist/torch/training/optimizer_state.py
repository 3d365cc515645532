"""What a ``DistributedOptimizer`` keeps in a checkpoint: the wrapped optimizer's state, the
steps taken (``distributed_after`` counts them) and, per rank, 1-bit residuals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipydist.torch.training import checkpoint
from ipydist.torch.training.wrapping import OptimizerMixinBase

if TYPE_CHECKING:
    import torch

    from ipydist.torch.training.gradients.buckets import Bucket

#: Key of ipydist's own entries in the optimizer's state dict.
_STATE_KEY = "ipydist"


class CheckpointMixin(OptimizerMixinBase):
    """``DistributedOptimizer``'s state methods (mixed in before the wrapped class's own)."""

    if TYPE_CHECKING:  # set by DistributedOptimizer's setup
        _steps: torch.Tensor
        _buckets: list[Bucket]

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, plus the steps taken (for ``distributed_after``)."""
        state = super().state_dict()
        state[_STATE_KEY] = {"steps": int(self._steps)}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` returned; from a checkpoint written by
        ``hvd.save_checkpoint``, also this rank's own 1-bit residuals."""
        state_dict = dict(state_dict)
        ours = state_dict.pop(_STATE_KEY, None) or {}
        per_rank = state_dict.pop(checkpoint.RANK_STATE_KEY, None)
        super().load_state_dict(state_dict)
        self._steps.fill_(int(ours.get("steps", 0)))
        mine = checkpoint.this_ranks(per_rank, "DistributedOptimizer's 1-bit residuals")
        saved = (mine or {}).get("onebit") or [None] * len(self._buckets)
        for bucket, state in zip(self._buckets, saved):  # none saved: start afresh
            bucket.onebit = None
            if bucket.correction is not None:
                bucket.correction.load(None)
            if state is not None:
                bucket.onebit_exchange().load(state)

    def _ipydist_rank_state(self) -> dict | None:
        """What differs between ranks and a checkpoint must keep per rank: 1-bit residuals
        (and the velocity of a momentum correction)."""
        states = [None if b.onebit is None else b.onebit.state() for b in self._buckets]
        return None if all(s is None for s in states) else {"onebit": states}
