"""GPU path: NCCL backend, CUDA tensors, one GPU pinned per rank. Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

import ipydist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_session():
    n = torch.cuda.device_count()
    with ipydist.Session(np=n, gpus="auto") as s:
        yield s


def test_ranks_are_pinned_to_their_gpu_and_use_nccl(gpu_session):
    assert [r["device"] for r in gpu_session.ranks] == [
        f"cuda:{i}" for i in range(gpu_session.size)
    ]
    assert {r["backend"] for r in gpu_session.ranks} == {"nccl"}
    gpu_session.run(
        "import torch, ipydist.torch as hvd\n"
        "pinned = (torch.cuda.current_device(), str(hvd.device()))"
    )
    assert gpu_session.pull("pinned") == [(i, f"cuda:{i}") for i in range(gpu_session.size)]


def test_collectives_on_cuda_tensors(gpu_session):
    n = gpu_session.size
    gpu_session.run(
        "t = torch.full((1000,), float(hvd.rank()), device=hvd.device())\n"
        "s = hvd.allreduce(t, op=hvd.Sum)\n"
        "g = hvd.allgather(t[: hvd.rank() + 1])\n"
        "b = hvd.broadcast(t, root_rank=hvd.size() - 1)\n"
        "o = hvd.broadcast_object({'r': hvd.rank()}, root_rank=0)\n"
        "res = (s.device.type, s[0].item(), g.numel(), b[0].item(), o)"
    )
    total = float(sum(range(n)))
    assert gpu_session.pull("res") == [
        ("cuda", total, n * (n + 1) // 2, float(n - 1), {"r": 0})
    ] * n


def test_horovod_style_set_device_matches(gpu_session):
    gpu_session.run(
        "torch.cuda.set_device(hvd.local_rank())\n"
        "model = torch.nn.Linear(4, 2).cuda()\n"
        "hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "w = model.weight.detach().cpu()"
    )
    ws = gpu_session.pull("w")
    assert all(w.equal(ws[0]) for w in ws)


def test_onebit_and_block_momentum_train_cuda_models(gpu_session):
    """1-bit SGD quantizes on the CPU (a copy of each bucket) and writes the averaged gradients
    back to the GPU; block momentum averages the models with NCCL. Both keep ranks identical."""
    gpu_session.run(
        "torch.manual_seed(0)\n"
        "def check(wrap, steps=6):\n"
        "    model = torch.nn.Linear(600, 3).to(hvd.device())\n"
        "    hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "    for _ in range(steps):\n"
        "        opt.zero_grad()\n"
        "        model(torch.randn(8, 600, device=hvd.device())).square().mean().backward()\n"
        "        opt.step()\n"
        "    w = model.weight.detach()\n"
        "    return (w.device.type, bool(hvd.allreduce(w, op=hvd.Max).equal(\n"
        "        hvd.allreduce(w, op=hvd.Min))))\n"
        "gpu_res = [check(lambda o: hvd.DistributedOptimizer(\n"
        "               o, compression=hvd.Compression.onebit)),\n"
        "           check(lambda o: hvd.BlockMomentum(o, block_steps=3))]"
    )
    assert gpu_session.pull("gpu_res") == [[("cuda", True), ("cuda", True)]] * gpu_session.size
