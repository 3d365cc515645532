"""Momentum correction (ipydist.torch.training.gradients.momentum_correction) against
torch.optim.SGD itself: with the exchange left out (one rank, what it sends is what comes back),
the corrected steps are SGD's own steps. Pure arithmetic, no cluster; the cluster tests train with
it on 4 ranks."""

from __future__ import annotations

import pytest
import torch

from ipydist.torch.training.gradients import momentum_correction as mc

SETTINGS = [
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.5, dampening=0.3, weight_decay=0.01),
    dict(momentum=0.9, nesterov=True, weight_decay=0.05, maximize=True),
]


def params(seed: int) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]


def gradients(step: int, ps) -> list[torch.Tensor]:
    torch.manual_seed(100 + step)
    return [torch.randn_like(p) for p in ps]


def corrected_step(opt, correction, grads, scale=1.0) -> None:
    """One step as DistributedOptimizer takes it with 1-bit, the exchange left out."""
    flat = torch.cat([g.reshape(-1) for g in grads]) * scale
    sent = correction.apply(flat) / scale
    for p, piece in zip(correction.params, sent.split([p.numel() for p in correction.params])):
        p.grad = piece.view_as(p).clone()
    with mc.plain_step(opt):
        opt.step()
    correction.commit()


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
@pytest.mark.parametrize("warm", [0, 3], ids=["from-the-start", "after-a-warm-start"])
def test_corrected_steps_are_sgds_own_steps(settings, warm):
    """The velocity plays SGD's momentum buffer (scaled by one rank's share), weight decay,
    dampening, Nesterov and maximize are applied before the quantizer, and after a warm start
    the velocity takes over SGD's buffers. The first step differs with dampening only: SGD's
    buffer starts undamped, the velocity from zero."""
    reference, ours = params(0), params(0)
    ref_opt = torch.optim.SGD(reference, lr=0.1, **settings)
    opt = torch.optim.SGD([{"params": ours[:1]}, {"params": ours[1:]}], lr=0.1, **settings)
    correction = mc.MomentumCorrection(ours, opt, scale=0.25)  # as one of 4 ranks
    for step in range(8):
        grads = gradients(step, ours)
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        ref_opt.step()
        if step < warm:  # full precision: SGD with its own momentum
            for p, g in zip(ours, grads):
                p.grad = g.clone()
            opt.step()
        else:
            corrected_step(opt, correction, grads, scale=0.25)
        if settings.get("dampening") and warm == 0 and step == 0:
            for p, r in zip(ours, reference):  # start from the same point after step 1
                p.data.copy_(r.data)
                correction.velocity.copy_(torch.cat(
                    [ref_opt.state[r]["momentum_buffer"].reshape(-1) for r in reference]) * 0.25)
            continue
        for p, r in zip(ours, reference):
            assert torch.allclose(p, r, atol=1e-6), (step, p, r)
    assert all("momentum_buffer" not in opt.state[p] for p in ours), "SGD's buffers dropped"
    assert opt.param_groups[0]["momentum"] == settings["momentum"], "settings put back"


def test_it_applies_to_sgd_with_momentum_only():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert mc.applies(torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert not mc.applies(torch.optim.SGD(p, lr=0.1))
    assert not mc.applies(torch.optim.Adam(p, lr=0.1))


def test_an_abandoned_step_leaves_the_velocity_as_it_was():
    ps = params(1)
    opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    correction = mc.MomentumCorrection(ps, opt, scale=1.0)
    corrected_step(opt, correction, gradients(0, ps))
    kept = correction.velocity.clone()
    correction.apply(torch.cat([g.reshape(-1) for g in gradients(1, ps)]))  # never committed
    assert correction.velocity.equal(kept)
    assert correction.state().equal(kept)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(s))
def test_the_quantizer_applies_the_same_correction_on_the_way(settings):
    """``fused`` hands the correction to the 1-bit kernel, which applies it while it
    quantizes (one pass over the bucket): what it quantizes and the velocity it keeps are
    those of ``apply``."""
    from ipydist.torch.training.gradients import onebit

    ps_a, ps_b = params(2), params(2)
    opt_a = torch.optim.SGD(ps_a, lr=0.1, **settings)
    opt_b = torch.optim.SGD(ps_b, lr=0.1, **settings)
    a = mc.MomentumCorrection(ps_a, opt_a, scale=0.5)
    b = mc.MomentumCorrection(ps_b, opt_b, scale=0.5)
    for step in range(3):
        flat = torch.cat([g.reshape(-1) for g in gradients(step, ps_a)])
        sent = a.apply(flat.clone()).clone()
        values = flat.clone()
        momentum = b.fused(values)
        out = torch.empty_like(values)
        q = onebit.quantize_with_feedback(values, torch.zeros_like(values), out=out,
                                          momentum=momentum)
        assert torch.allclose(out + onebit.dequantize(q), sent, atol=1e-6)
        a.commit()
        b.commit()
        assert torch.allclose(a.velocity, b.velocity, atol=1e-6)


def test_param_groups_of_different_momentum_are_not_fused():
    ps = params(3)
    opt = torch.optim.SGD([{"params": ps[:1], "momentum": 0.9}, {"params": ps[1:]}], lr=0.1,
                          momentum=0.5)
    correction = mc.MomentumCorrection(ps, opt, scale=1.0)
    assert correction.fused(torch.zeros(correction.numel)) is None
