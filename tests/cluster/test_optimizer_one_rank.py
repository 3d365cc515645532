"""DistributedOptimizer on a cluster of one rank (issue 48): the average over one rank is the
gradient itself, so a step sends, packs and waits for nothing, and trains bit for bit as the
wrapped optimizer does alone; compression still rounds, and misuse is still refused."""

from __future__ import annotations

import pytest

import ipydist

SETUP = """
import torch, ipydist.torch as hvd
def pair(make_opt, **options):
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    ref = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    ref.load_state_dict(model.state_dict())
    # buckets of 0.004 MB: several, so the gradient hooks run as on more ranks
    opt = hvd.DistributedOptimizer(make_opt(model.parameters()), bucket_cap_mb=0.004,
                                   named_parameters=model.named_parameters(), **options)
    return model, opt, ref, make_opt(ref.parameters())
def train(make_opt, steps=5, passes=1, **options):
    model, opt, ref, ref_opt = pair(make_opt, backward_passes_per_step=passes, **options)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        opt.zero_grad(); ref_opt.zero_grad()
        for _ in range(passes):
            x = torch.randn(8, 32, generator=g)
            model(x).square().mean().backward()
            ref(x).square().mean().backward()
        opt.step(); ref_opt.step()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return same, opt.bytes_sent, len(opt._buckets)
SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01)
"""


@pytest.fixture(scope="module")
def one_rank():
    with ipydist.Session(np=1) as s:
        s.run(SETUP)
        yield s


@pytest.mark.parametrize("make_opt", ["SGD", "ADAM"])
@pytest.mark.parametrize("passes", [1, 2])
def test_one_rank_trains_bit_for_bit_as_the_plain_optimizer_and_sends_nothing(
        one_rank, make_opt, passes):
    one_rank.run(f"outcome = train({make_opt}, passes={passes})")
    same, sent, buckets = one_rank.pull("outcome", rank=0)
    assert same and sent == 0 and buckets > 1, (same, sent, buckets)


def test_fp16_compression_still_rounds_the_gradient_on_one_rank(one_rank):
    one_rank.run("outcome = train(SGD, compression=hvd.Compression.fp16)")
    same, _, _ = one_rank.pull("outcome", rank=0)
    assert not same  # as on more ranks: the gradient went through 16 bits


def test_synchronize_then_step_and_misuse_on_one_rank(one_rank):
    one_rank.run("""
model, opt, ref, ref_opt = pair(SGD)
x = torch.randn(8, 32)
opt.zero_grad(); ref_opt.zero_grad()
model(x).sum().backward(); ref(x).sum().backward()
opt.synchronize()
torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
with opt.skip_synchronize():
    opt.step()
ref_opt.step()
clipped = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
opt.zero_grad()
model(x).sum().backward()
try:
    model(x).sum().backward()  # twice before step, with backward_passes_per_step=1
    twice = "no error"
except RuntimeError as e:
    twice = str(e)
""")
    assert one_rank.pull("clipped", rank=0)
    assert "was computed again before step()" in one_rank.pull("twice", rank=0)
