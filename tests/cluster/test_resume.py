"""Save, stop, start a fresh cluster, load: training resumes bit for bit."""

from __future__ import annotations

import ipydist

SETUP = """
import torch, ipydist.torch as hvd
torch.manual_seed(0)
X, Y = torch.randn(256, 8), torch.randn(256, 1)
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
def train(steps):
    for s in steps:
        lo = (s * hvd.size() + hvd.rank()) * 8 % 256
        opt.zero_grad()
        ((model(X[lo:lo + 8]) - Y[lo:lo + 8]) ** 2).mean().backward()
        opt.step()
def weights():
    return [p.detach().clone() for p in model.parameters()]
"""


def test_resume_after_a_fresh_cluster_is_bit_identical(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with ipydist.Session(np=2) as s:
        s.run(SETUP)
        s.run(f"train(range(3)); hvd.save_checkpoint({path!r}, model=model, optimizer=opt)")
        s.run("train(range(3, 6)); straight = weights()")
        straight = s.pull("straight")
    with ipydist.Session(np=2) as s:  # new processes: nothing but the file carries over
        s.run(SETUP)
        s.run(f"ck = hvd.load_checkpoint({path!r}); model.load_state_dict(ck['model'])\n"
              "opt.load_state_dict(ck['optimizer'])")
        s.run("train(range(3, 6)); resumed = weights()")
        resumed = s.pull("resumed")
    for rank in range(2):
        assert all(a.equal(b) for a, b in zip(straight[rank], resumed[rank]))
    assert all(a.equal(b) for a, b in zip(resumed[0], resumed[1]))
