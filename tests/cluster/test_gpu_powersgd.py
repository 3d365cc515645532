"""PowerSGD on CUDA buckets: the matrices, the error feedback and Q stay on the GPU, the
allreduces go over NCCL, and backward (where the buckets start) never waits for the device.
Run with ``pytest -m gpu`` (one rank per GPU, at least 2: on one GPU two ranks share it).
The CPU path is tested on a CPU cluster (test_cntk_learners.py) and its arithmetic in
tests/logic/test_powersgd_logic.py."""

from __future__ import annotations

import pytest
import torch

import ipydist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SETUP = """
import torch, ipydist.torch as hvd
N, r, b, dev = hvd.size(), hvd.rank(), 16, hvd.device()
torch.manual_seed(0)
X = torch.randn(4000, 20)
Y = X @ torch.randn(20, 1) + 0.1 * torch.randn(4000, 1)
def train(device, steps=30, strict=False):
    torch.manual_seed(1)  # made on the CPU, then moved: the same model on either device
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1)).to(device)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), bucket_cap_mb=0.005,
        compression=hvd.Compression.powersgd(rank=2, start_iter=2))
    for step in range(steps):
        lo = (step * N * b) % (len(X) - N * b) + r * b
        x, y = X[lo:lo + b].to(device), Y[lo:lo + b].to(device)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if strict:
            torch.cuda.set_sync_debug_mode("error")  # any wait of the host raises
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.step()
    kept = [b.kept for b in opt._buckets if b.kept is not None]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat.cpu(), len(opt._buckets), {str(k.error.device) for k in kept}
def same_everywhere(t):
    t = t.to(dev)
    return bool(hvd.allreduce(t, op=hvd.Max).equal(hvd.allreduce(t, op=hvd.Min)))
"""


def test_powersgd_trains_cuda_buckets_on_the_gpu_with_no_sync_in_backward():
    with ipydist.Session(np=max(2, torch.cuda.device_count()), gpus="auto",
                         backend="nccl") as s:
        s.run(SETUP)
        s.run("""
gpu, buckets, where = train(dev, strict=True)
cpu, _, _ = train("cpu")
outcome = (buckets, where, same_everywhere(gpu), torch.allclose(gpu, cpu, rtol=1e-3, atol=1e-4))
""")
        for buckets, where, identical, like_cpu in s.pull("outcome"):
            assert buckets > 1, "several buckets: started from the gradient hooks"
            assert where and all(w.startswith("cuda") for w in where), where
            assert identical
            assert like_cpu, "the GPU path computes what the CPU path does"
