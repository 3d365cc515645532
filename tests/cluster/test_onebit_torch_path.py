"""1-bit SGD's GPU path (torch operations, ``onebit_torch``) on a 4-rank CPU cluster, against
the numba path: ``OneBitExchange.torch_on_cpu`` sends CPU buckets through it, so the exchange
around it (stripes, owner step, residuals, momentum correction, checkpoints) runs here, on
both wires, without a GPU. tests/cluster/test_gpu_onebit.py runs it on CUDA buckets."""

from __future__ import annotations

from helpers import run_ok

SETUP = """%%everyrank
import torch, ipydist.torch as hvd
from ipydist.torch.training.gradients.onebit_exchange import OneBitExchange
N, r, b = hvd.size(), hvd.rank(), 16
torch.manual_seed(0)
X = torch.randn(4000, 20)
Y = X @ torch.randn(20, 1) + 0.1 * torch.randn(4000, 1)
def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
def fresh(**settings):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, **settings),
                                   compression=hvd.Compression.onebit, bucket_cap_mb=0.0002)
    return model, opt
def train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        lo = (step * N * b) % (len(X) - N * b) + r * b
        opt.zero_grad()
        ((model(X[lo:lo + b]) - Y[lo:lo + b]) ** 2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
def same_everywhere(t):
    return bool(hvd.allreduce(t, op=hvd.Max).equal(hvd.allreduce(t, op=hvd.Min)))
"""


def test_the_torch_path_trains_as_the_numba_path(shell, capsys, cluster, transport, tmp_path):
    """With and without momentum correction, over several buckets: the ranks stay identical,
    the parameters match the numba path's (to float32 noise: a group sum may round the other
    way), and a checkpoint of the torch path's residuals and velocity resumes bit for bit."""
    path = str(tmp_path / "torch-path.pt")
    run_ok(shell, capsys, SETUP)
    run_ok(shell, capsys, f"""%%everyrank
outcome = []
for settings in ({{}}, {{"momentum": 0.9}}, {{"momentum": 0.9, "nesterov": True}}):
    OneBitExchange.torch_on_cpu = False
    numba = train(*fresh(**settings), 12)
    OneBitExchange.torch_on_cpu = True
    model, opt = fresh(**settings)
    kinds = len(opt._buckets)
    ours = train(model, opt, 12)
    hvd.save_checkpoint({path!r}, model=model, optimizer=opt)
    straight = train(model, opt, 4, 12)
    model, opt = fresh(**settings)
    ck = hvd.load_checkpoint({path!r})
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    resumed = train(model, opt, 4, 12)
    outcome.append((kinds > 1, same_everywhere(ours), (ours - numba).abs().max().item(),
                    bool(torch.allclose(ours, numba, rtol=1e-3, atol=1e-5)),
                    resumed.equal(straight), same_everywhere(resumed)))
OneBitExchange.torch_on_cpu = False
""")
    for per_rank in shell.run_line_magic("dist_pull", "outcome"):
        for several, identical, gap, close, resumed, identical_after in per_rank:
            assert several and identical and identical_after, per_rank
            assert close, gap
            assert resumed, "resumed training differs from training straight on"
