"""The learners give the hooks that ipydist's checkpoint, recovery and heal code find by the
Protocols of ``torch/_core/learner_hooks.py`` (a hook renamed on one side only would be found
nowhere: the checkpoint would lose 1-bit's residuals, the recovery would leave a step half
done, a resize would average over the old size)."""

from __future__ import annotations

import inspect

from ipydist.torch._core.learner_hooks import AbandonsPending, FollowsResize, KeepsRankState
from ipydist.torch.training.block_momentum import _BlockMomentumMixin
from ipydist.torch.training.optimizer import _DistributedMixin


def test_distributed_optimizer_gives_every_hook():
    for hook in (KeepsRankState, AbandonsPending, FollowsResize):
        assert issubclass(_DistributedMixin, hook), hook.__name__


def test_block_momentum_keeps_its_rank_state():
    assert issubclass(_BlockMomentumMixin, KeepsRankState)


def test_the_hooks_take_no_arguments_as_declared():
    for learner, hooks in ((_DistributedMixin, ("_ipydist_rank_state", "_abandon_pending",
                                                "_ipydist_resized")),
                           (_BlockMomentumMixin, ("_ipydist_rank_state",))):
        for name in hooks:
            assert list(inspect.signature(getattr(learner, name)).parameters) == ["self"], name
