"""The hooks ipydist calls on a learner that keeps state of its own (``DistributedOptimizer``,
``BlockMomentum``), declared once. The checkpoint code, the recovery and the heal find them by
these Protocols, not by a name looked up with ``getattr``, and the type check holds each
learner to their signatures (``tests/logic/test_learner_hooks.py`` holds the learners to
them at run time). The names are private: they are ipydist's, on the user's objects."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class KeepsRankState(Protocol):
    """Keeps state that differs between ranks by design (1-bit's residuals, PowerSGD's error
    feedback, a block's local model): ``hvd.save_checkpoint`` stores each rank's own."""

    def _ipydist_rank_state(self) -> dict | None:
        """This rank's own state, or None when there is none yet."""
        ...


@runtime_checkable
class AbandonsPending(Protocol):
    """Has a step's collectives in flight, which a failed or interrupted cell voids."""

    def _abandon_pending(self) -> None:
        """Forget the half-done step on this rank (every rank is told alike)."""
        ...


@runtime_checkable
class FollowsResize(Protocol):
    """Averages over the world's size, which ``%dist_scale`` and a heal's shrink change."""

    def _ipydist_resized(self) -> None:
        """The world changed size: take the new one."""
        ...
