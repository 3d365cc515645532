"""Momentum correction for 1-bit SGD: each rank keeps SGD's momentum for its own gradients and
quantizes that, instead of quantizing gradients and applying momentum to their average (Lin et
al., "Deep Gradient Compression", ICLR 2018, section 3.2; Zheng et al., "Communication-Efficient
Distributed Blockwise Momentum SGD with Error-Feedback", NeurIPS 2019).

Why. Error feedback delays what a message could not carry to later steps; heavy-ball momentum
after the average multiplies every such delayed piece by up to ``1 / (1 - momentum)`` (10 at
0.9), so the quantization error reaches the parameters ten times over. Kept before the
quantizer, momentum is part of what is sent and the error reaches them once. Measured
(``benchmarks/onebit_accuracy.py``: 4 ranks emulated in one process, digits, SGD momentum 0.9
at full precision's learning rate, groups of 64, 30 epochs, 4 seeds): with momentum after the
average, 1-bit trained the CNN to 0.78 (spread between seeds 0.27) and the MLP to 0.951, where
full precision reached 0.981 and 0.969; with momentum before the quantizer, 0.982 and 0.974.

Algorithm, for a torch.optim.SGD param group with momentum ``m``, dampening ``d``, weight
decay ``wd`` and Nesterov or not, on rank r, with ``s = 1 / (N * postscale)`` so that the ranks'
sum, scaled as the optimizer scales it, is SGD's own update:

1. ``g_r`` = this rank's (prescaled) gradient, negated if ``maximize``, plus ``s * wd * p``;
2. ``v_r = m * v_r + (1 - d) * g_r`` (the rank's velocity; the sum over ranks is SGD's buffer);
3. the rank quantizes ``g_r + m * v_r`` (Nesterov) or ``v_r``, with error feedback;
4. the wrapped SGD steps with the decoded sum as its gradient and momentum, weight decay and
   maximize set aside for that step (:func:`plain_step`): they were applied before.

The velocity takes its new value only when the step completes (a step abandoned by an
interrupt leaves it as it was), starts from SGD's own momentum buffers when 1-bit begins after
a warm start (``distributed_after``), and is kept per rank in checkpoints, as the residuals are.
A parameter without a gradient on this rank counts as a zero gradient (its velocity decays).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ipydist.torch.training.gradients.onebit import Momentum

#: SGD's settings that the correction applies before the quantizer, set aside in its step.
_APPLIED_BEFORE = {"momentum": 0.0, "weight_decay": 0.0, "maximize": False, "nesterov": False}


def applies(optimizer: torch.optim.Optimizer) -> bool:
    """Whether 1-bit steps of ``optimizer`` keep momentum per rank: torch.optim.SGD with
    momentum in some param group (plain SGD and other optimizers quantize gradients)."""
    return isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0.0) for g in optimizer.param_groups)


class MomentumCorrection:
    """The velocity of one bucket's parameters on this rank, and how to fold SGD's momentum,
    weight decay and maximize into what the bucket sends."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 scale: float) -> None:
        self.params, self.scale = params, scale
        # the optimizer, not its state or groups: load_state_dict replaces both
        self._optimizer = optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._slices: list[tuple[int, int]] = []
        self._runs: list[list[int]] = []  # [start, stop, param group's index]
        start = 0
        for p in params:
            group, stop = group_of[id(p)], start + p.numel()
            self._slices.append((start, stop))
            if self._runs and self._runs[-1][2] == group:  # one run per param group
                self._runs[-1][1] = stop
            else:
                self._runs.append([start, stop, group])
            start = stop
        self.numel = start
        self.velocity: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        self._adopted = False

    @property
    def device(self) -> torch.device:
        """Where the bucket's gradients, and so the velocity, lie."""
        return self.params[0].device

    def _start(self) -> None:
        """Zero velocity, or SGD's buffers (scaled to one rank's share) after a warm start,
        made where the bucket lies (on a GPU: inside the gradient hook, with no copy from the
        host)."""
        self.velocity = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._next = torch.empty_like(self.velocity)
        for p, (start, stop) in zip(self.params, self._slices):
            buffer = self._optimizer.state.get(p, {}).get("momentum_buffer")
            if buffer is not None:
                self.velocity[start:stop] = buffer.detach().reshape(-1).to(self.velocity) \
                    * self.scale

    def _fold(self, values: torch.Tensor) -> None:
        """``maximize`` and weight decay into ``values`` (in place), run by run."""
        for start, stop, index in self._runs:
            group = self._optimizer.param_groups[index]
            if group.get("maximize", False):
                values[start:stop].neg_()
            decay = group.get("weight_decay", 0.0)
            if decay:
                for p, (a, b) in zip(self.params, self._slices):
                    if start <= a < stop:
                        values[a:b].add_(p.detach().reshape(-1).to(values),
                                         alpha=decay * self.scale)

    def fused(self, values: torch.Tensor) -> Momentum | None:
        """For the quantizer to apply on the way (one pass over the bucket instead of two):
        the velocities and SGD's settings, with ``maximize`` and weight decay already folded
        into ``values``; None where the bucket's param groups differ in momentum, dampening
        or Nesterov (then :meth:`apply`)."""
        settings = {(g.get("momentum", 0.0), g.get("dampening", 0.0), g.get("nesterov", False))
                    for g in (self._optimizer.param_groups[i] for _, _, i in self._runs)}
        if len(settings) != 1:
            return None
        if self.velocity is None:
            self._start()
        self._fold(values)
        (m, damp, nesterov), = settings
        return Momentum(self.velocity, self._next, m, 1.0 - damp, nesterov)

    def apply(self, values: torch.Tensor) -> torch.Tensor:
        """What this rank sends in place of ``values`` (its prescaled gradients, float32 on
        the bucket's device, changed in place): the new velocity, or with Nesterov the
        gradients plus momentum times it. The new velocity is kept until :meth:`commit`."""
        if self.velocity is None:
            self._start()
        assert self.velocity is not None and self._next is not None  # made together
        self._fold(values)
        nesterov = []
        for start, stop, index in self._runs:
            group, g = self._optimizer.param_groups[index], values[start:stop]
            m, damp = group.get("momentum", 0.0), group.get("dampening", 0.0)
            v, nv = self.velocity[start:stop], self._next[start:stop]
            if damp:
                torch.add(v.mul(m), g, alpha=1.0 - damp, out=nv)
            else:
                torch.add(g, v, alpha=m, out=nv)
            nesterov.append(group.get("nesterov", False))
            if nesterov[-1]:
                g.add_(nv, alpha=m)
        if not any(nesterov):  # the velocity itself is sent: no copy of it
            return self._next
        for (start, stop, _), keeps_gradient in zip(self._runs, nesterov):
            if not keeps_gradient:
                values[start:stop].copy_(self._next[start:stop])
        return values

    def commit(self) -> None:
        """The step completed: its velocity becomes the current one (SGD's own buffers, which
        1-bit replaced, are dropped the first time)."""
        self.velocity, self._next = self._next, self.velocity
        if not self._adopted:
            for p in self.params:
                self._optimizer.state.get(p, {}).pop("momentum_buffer", None)
            self._adopted = True

    def rescale(self, scale: float) -> None:
        """The world changed size: one rank's share is now ``scale`` (1 / (N * postscale));
        the velocity, kept as a share, follows, so that the ranks' sum stays SGD's own."""
        if self.velocity is not None and self.scale:
            self.velocity.mul_(scale / self.scale)
        self.scale = scale

    def state(self) -> torch.Tensor | None:
        """The velocity, on the CPU (a checkpoint is read where there may be no GPU)."""
        return None if self.velocity is None else self.velocity.to("cpu", copy=True)

    def load(self, velocity: torch.Tensor | None) -> None:
        """A checkpoint's velocity (on the CPU), moved to the bucket's device."""
        if velocity is None:
            self.velocity = self._next = None
            return
        self.velocity = velocity.detach().to(self.device, torch.float32, copy=True)
        self._next = torch.empty_like(self.velocity)
        self._adopted = True


@contextlib.contextmanager
def plain_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """SGD's step with momentum, weight decay and maximize set aside (the correction applied
    them before the quantizer), put back afterwards."""
    saved = [{k: g[k] for k in _APPLIED_BEFORE if k in g} for g in optimizer.param_groups]
    for group, kept in zip(optimizer.param_groups, saved):
        group.update({k: _APPLIED_BEFORE[k] for k in kept})
    try:
        yield
    finally:
        for group, kept in zip(optimizer.param_groups, saved):
            group.update(kept)
