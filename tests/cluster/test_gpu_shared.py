"""More ranks than GPUs (issue 48): a one-GPU workstation runs the quickstart as it is written.

Every test here puts 2-4 ranks on ONE GPU (``--gpus 0``, or ``CUDA_VISIBLE_DEVICES`` naming one
for what reads the default), with the default backend: NCCL's shared mode where the machine's
NCCL has it (2.30), else gloo carrying the CUDA tensors. ``test_gpu_nccl.py`` runs NCCL's own
behaviour on one GPU, and the elastic heal here also runs with a GPU each where there are two.
Run with ``pytest -m gpu``; the device plans themselves are tested without a GPU
(``tests/logic/test_gpu_sharing.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

import nbformat
import pytest
import torch

import ipydist
from ipydist import cli
from ipydist.cli import doctor
from ipydist.errors import RankDied

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def shared():
    """4 ranks on GPU 0, the default backend."""
    with ipydist.Session(np=4, gpus="0") as s:
        s.run("import os, torch, torch.distributed as dist, ipydist.torch as hvd")
        yield s


def test_four_ranks_are_dealt_the_one_gpu_and_say_how_their_tensors_travel(shared, capsys):
    ways = {r["gpu_sharing"] for r in shared.ranks}
    assert len(ways) == 1 and ways <= {"nccl", "gloo"}, ways
    (way,) = ways
    assert [r["device"] for r in shared.ranks] == ["cuda:0"] * 4
    assert {r["backend"] for r in shared.ranks} == {"nccl" if way == "nccl" else "gloo"}
    shared.run("nccl = '.'.join(map(str, torch.cuda.nccl.version()))\n"
               "seen = (torch.cuda.current_device(), os.environ.get("
               "'NCCL_MULTI_RANK_GPU_ENABLE'), nccl)")
    seen = shared.pull("seen")
    print(f"NCCL {seen[0][2]}: ranks share the GPU by {way}", file=sys.__stderr__)
    assert all(s[0] == 0 and (s[1] == "1") == (way == "nccl") for s in seen), seen


def test_collectives_on_cuda_tensors_of_ranks_sharing_a_gpu(shared):
    shared.run("""
n, r, dev = hvd.size(), hvd.rank(), hvd.device()
ok = {}
t = torch.full((1000,), float(r), device=dev)
ok["allreduce"] = hvd.allreduce(t, op=hvd.Sum)[0].item() == sum(range(n))
ok["average"] = hvd.allreduce(t)[0].item() == sum(range(n)) / n
ok["allgather"] = hvd.allgather(t[: r + 1]).numel() == n * (n + 1) // 2
ok["broadcast"] = hvd.broadcast(t, root_rank=n - 1)[0].item() == n - 1
a = hvd.alltoall(torch.arange(n, device=dev) + 100 * r)  # gloo has none for CUDA: via the CPU
ok["alltoall"] = a.tolist() == [100 * j + r for j in range(n)] and a.is_cuda
rs = hvd.reducescatter(torch.ones(2 * n, device=dev), op=hvd.Sum)
ok["reducescatter"] = rs.tolist() == [float(n)] * 2 and rs.is_cuda
ok["object"] = hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
hvd.barrier()
bad = sorted(k for k, v in ok.items() if not v)
""")
    assert shared.pull("bad") == [[]] * 4


def test_horovods_set_device_and_a_ddp_script_s_nccl_run_unchanged(shared):
    """``torch.cuda.set_device(hvd.local_rank())`` pins the shared GPU; a DDP script's
    ``init_process_group("nccl")`` keeps the cluster's group; both train identically."""
    shared.run("""
torch.cuda.set_device(hvd.local_rank())
dist.init_process_group("nccl")
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
ddp = DDP(net)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator().manual_seed(hvd.rank())
for _ in range(5):
    opt.zero_grad()
    ddp(torch.randn(16, 32, generator=g).cuda()).square().mean().backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
ddp_same = bool(hvd.allreduce(flat, op=hvd.Max).equal(hvd.allreduce(flat, op=hvd.Min)))
pinned = (torch.cuda.current_device(), str(next(net.parameters()).device), ddp_same)
""")
    assert shared.pull("pinned") == [(0, "cuda:0", True)] * 4


def test_distributed_optimizer_on_a_shared_gpu_matches_one_process(shared):
    """The averaged step equals one process's step on the union of the ranks' batches."""
    shared.run("""
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.Tanh(),
                            torch.nn.Linear(256, 1)).to(hvd.device())
reference = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 1)).to(hvd.device())
reference.load_state_dict(model.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
for step in range(5):
    xs = [torch.randn(8, 20, generator=torch.Generator().manual_seed(100 * step + k))
          for k in range(hvd.size())]
    opt.zero_grad(); ref_opt.zero_grad()
    model(xs[hvd.rank()].to(hvd.device())).square().mean().backward()
    opt.step()
    reference(torch.cat(xs).to(hvd.device())).square().mean().backward()
    ref_opt.step()
gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                    reference.parameters()))
""")
    assert all(gap < 1e-5 for gap in shared.pull("gap")), shared.pull("gap")


@pytest.mark.parametrize("gpus", ["0", "auto"])
def test_an_elastic_heal_gives_the_replacement_rank_0s_cuda_state_on_its_own_gpu(gpus):
    """Rank 1 is SIGKILLed between cells; its replacement holds rank 0's CUDA tensors on the
    GPU the replacement was dealt (``auto`` on two GPUs: cuda:1, not rank 0's cuda:0), with
    what they shared still shared."""
    if gpus == "auto" and torch.cuda.device_count() < 2:
        pytest.skip("a GPU each needs 2 GPUs; the shared form (gpus 0) runs on one")
    with ipydist.Session(np=2, gpus=gpus, elastic=True) as s:
        s.run("import torch, ipydist.torch as hvd\n"
              "torch.manual_seed(0)\n"
              "w = hvd.broadcast(torch.randn(1 << 20, device=hvd.device()), root_rank=0)\n"
              "kept = {'head': w[:10]}")
        before = s.ranks[1]["pid"]
        os.kill(before, signal.SIGKILL)
        with contextlib.suppress(RankDied):
            s.run("pass")
        s.healed()
        assert s.ranks[1]["pid"] != before
        s.run("seen = (str(w.device), str(hvd.device()), "
              "kept['head'].data_ptr() == w.data_ptr(), w.cpu())")
        seen = s.pull("seen")
    assert [x[0] for x in seen] == [x[1] for x in seen], seen  # on each rank's own GPU
    assert all(x[2] for x in seen) and torch.equal(seen[0][3], seen[1][3])


def test_doctor_s_cluster_check_passes_on_one_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    check = doctor.check_cluster(2)
    assert check.status == doctor.OK, check


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.stem)
def test_every_notebook_runs_with_its_ranks_sharing_one_gpu(notebook, tmp_path, monkeypatch):
    """As written (``%dist_start --np 4``), under a ``CUDA_VISIBLE_DEVICES`` of one GPU: the
    only errors are the cells tagged to raise, and the start table says the ranks share."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = tmp_path / notebook.name
    assert cli.main(["run", str(notebook), "--output", str(out)]) == 0
    nb = nbformat.read(out, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    failed = [c.source.splitlines()[0] for c in code
              if any(o.output_type == "error" for o in c.get("outputs", []))
              and "raises-exception" not in c.metadata.get("tags", [])]
    assert failed == [], failed
    shown = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                    for c in code for o in c.get("outputs", []))
    assert "share 1 GPU" in " ".join(shown.split()), notebook.name
