"""Images per second of a ResNet trained on synthetic data: DistributedOptimizer, DDP, and alone.

Horovod's synthetic benchmark's method (its ``pytorch_synthetic_benchmark.py``), measured for
ipydist's ranks: torchvision's ResNet-50 built from its config (no weights downloaded), a batch
of 32 random 224x224 images and random labels made once on the rank's device, SGD with lr
0.01; 10 warm-up batches, then 10 timed iterations of 10 batches; images per second per rank as
the mean +- 1.96 sigma over the iterations (Horovod's way), and in total (np times that). Three
variants on the same ranks in one run:

- ``plain``: each rank trains its own copy alone, with no exchange (the floor);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the cluster's default group
  (NCCL on GPUs, gloo on the CPU);
- ``hvd``: ``hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())`` after
  ``hvd.broadcast_parameters``, on the transport ipydist chose.

Every variant is built and warmed up first (one after the other), then the timed iterations are
interleaved iteration by iteration: each round times one iteration of each variant, in an order
that rotates round by round, so that changes in machine load hit them alike. An iteration's time
is the slowest rank's (synchronous training goes at its pace). Printed per variant: images/s per
rank (mean +- 1.96 sigma, and the median), total images/s, and the peak GPU memory of its
warm-up (``torch.cuda.max_memory_allocated``, reset before it, less what was allocated before
it began: the other variants' models and the batch); then hvd/plain and hvd/ddp of the mean
images/s, with the median of the per-round ratios beside them. On the CPU the memory column
says n/a: the CPU allocator keeps what it frees, so a resident-size delta would depend on the
order in which the variants ran.

Target: on a GPU, hvd >= 0.97x plain's images/s at np=1 (exit status 1 when not met). On the
CPU the figures are informative: the defaults shrink the work (ResNet-18, batch 8, 64x64
images) so that np=2 on a 2-core machine takes about two minutes.

    .venv/bin/python benchmarks/synthetic.py                  # GPUs if any (np = their number)
    .venv/bin/python benchmarks/synthetic.py --np 1           # the GPU target: np=1
    .venv/bin/python benchmarks/synthetic.py --gpus none --np 2   # the CPU on any machine

Needs torchvision: ``pip install -c constraints.txt '.[bench]'``. Beside a CPU build of torch,
install torchvision's CPU build (``--index-url https://download.pytorch.org/whl/cpu``) or keep it
out of the environment the tests use (``pip install --no-deps --target DIR``, then
``PYTHONPATH=DIR``; the ranks inherit it): PyPI's torchvision is a CUDA build, and beside a CPU
torch it stops ``import lightning.pytorch`` and ``from transformers import Trainer``, which import
torchvision when it is there (this script itself gets around it, below).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import textwrap

import ipydist

VARIANTS = ["plain", "ddp", "hvd"]
#: hvd's images/s against plain's at np=1 on a GPU, at least.
GPU_TARGET = 0.97

RANK_CODE = textwrap.dedent('''
    import sys, time, torch
    import torch.nn.functional as F
    import ipydist.torch as hvd
    from torch.nn.parallel import DistributedDataParallel as DDP

    _torchvision_ops = None  # the schemas declared below, kept alive while the rank lives

    def import_torchvision():
        """torchvision, also where its compiled operators do not load.

        The torchvision wheels on PyPI are built for CUDA builds of torch; beside a CPU build of
        the same release (torch 2.13.0+cpu) their extension does not load, which torchvision
        passes over in silence, but its import then stops at registering a fake kernel for
        torchvision::nms, an operator only that extension declares ("operator torchvision::nms
        does not exist", pytorch/vision#9085). Declaring nms and qnms here lets the import
        finish. ResNet is torch.nn alone and uses none of the compiled operators; calling
        torchvision.ops.nms would still fail, saying that they did not load.
        """
        global _torchvision_ops
        try:
            import torchvision
            return torchvision
        except RuntimeError as e:
            if "torchvision::nms" not in str(e):
                raise
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]  # the half-done import, to run again from the start
        _torchvision_ops = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):  # the schemas its extension declares
            _torchvision_ops.define(
                f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision
        return torchvision

    torchvision = import_torchvision()
    _steps = {}
    _data = None

    def _sync():
        if hvd.device().type == "cuda":
            torch.cuda.synchronize(hvd.device())

    def make_data(batch, size):
        """One batch of random images and labels, on the device, shared by the variants."""
        global _data
        torch.manual_seed(1234 + hvd.rank())
        dev = hvd.device()
        _data = (torch.randn(batch, 3, size, size, device=dev),
                 torch.randint(0, 1000, (batch,), device=dev))
        if dev.type == "cuda":
            torch.backends.cudnn.benchmark = True  # as Horovod's benchmark: same shapes each batch
            return torch.cuda.get_device_name(dev)
        return None

    def build(variant, model_name, warmup):
        """Build ``variant`` and run its warm-up; returns its peak GPU memory in bytes (None on
        the CPU): the peak since the warm-up began less what was allocated before it."""
        dev = hvd.device()
        cuda = dev.type == "cuda"
        if cuda:
            _sync()
            torch.cuda.reset_peak_memory_stats(dev)
            before = torch.cuda.memory_allocated(dev)
        torch.manual_seed(0)
        model = getattr(torchvision.models, model_name)(weights=None).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if variant == "ddp":
            model = DDP(model, device_ids=[dev] if cuda else None)
        elif variant == "hvd":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        images, labels = _data

        def step():
            opt.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            opt.step()

        for _ in range(warmup):
            step()
        _sync()
        _steps[variant] = step
        return torch.cuda.max_memory_allocated(dev) - before if cuda else None

    def run_round(order, batches):
        """Seconds this rank took for ``batches`` batches of each variant, in ``order``."""
        times = {}
        for variant in order:
            step = _steps[variant]
            hvd.barrier()
            _sync()
            t0 = time.perf_counter()
            for _ in range(batches):
                step()
            _sync()
            times[variant] = time.perf_counter() - t0
        return times
''')


def gpu_count() -> int:
    """GPUs on this host, as torch counts them (0 where torch has no CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "resnet18"],
                        help="default: resnet50 on GPUs, resnet18 on the CPU")
    parser.add_argument("--batch-size", type=int, help="per rank; default: 32 on GPUs, 8 on CPU")
    parser.add_argument("--image-size", type=int, help="default: 224 on GPUs, 64 on the CPU")
    parser.add_argument("--np", type=int, help="default: the number of GPUs (listed in --gpus, "
                        "else on this host), else 2")
    parser.add_argument("--gpus", help="passed to the Session: auto (default where this host "
                        "has GPUs), none (default elsewhere) or a list such as 0,1")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up batches per variant")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per variant")
    parser.add_argument("--batches-per-iter", type=int, default=10)
    args = parser.parse_args(argv)
    gpus = gpu_count()
    if args.gpus is None:
        args.gpus = "auto" if gpus else "none"
    on_gpu = gpus > 0 and args.gpus != "none"
    listed = args.gpus not in ("auto", "none")  # a list such as 0,1: a rank for each
    args.np = args.np or (len(args.gpus.split(",")) if listed else gpus if on_gpu else 2)
    args.model = args.model or ("resnet50" if on_gpu else "resnet18")
    args.batch_size = args.batch_size or (32 if on_gpu else 8)
    args.image_size = args.image_size or (224 if on_gpu else 64)
    return args


def mean_conf(values: list[float]) -> tuple[float, float]:
    """Mean and 1.96 standard deviations (of the values themselves, as Horovod reports)."""
    return statistics.fmean(values), 1.96 * statistics.pstdev(values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("torchvision") is None:
        print("synthetic.py needs torchvision (its ResNet models): pip install -c "
              "constraints.txt '.[bench]' (beside a CPU build of torch, see this script's "
              "docstring first)", file=sys.stderr)
        return 2
    images = args.batch_size * args.batches_per_iter
    rounds: list[dict[str, float]] = []  # per round: variant -> the slowest rank's seconds
    with ipydist.Session(np=args.np, gpus=args.gpus) as s:
        s.run(RANK_CODE, output="rank0")
        s.run(f"gpu_name = make_data({args.batch_size}, {args.image_size})", output="rank0")
        gpu_name = s.pull("gpu_name", rank=0)
        peaks: dict[str, float | None] = {}
        for variant in VARIANTS:
            s.run(f"peak = build({variant!r}, {args.model!r}, {args.warmup})", output="rank0")
            per_rank = s.pull("peak")
            peaks[variant] = None if per_rank[0] is None else max(per_rank)
        for r in range(args.iters):
            k = r % len(VARIANTS)
            order = VARIANTS[k:] + VARIANTS[:k]
            s.run(f"t = run_round({order!r}, {args.batches_per_iter})", output="rank0")
            per_rank = s.pull("t")
            rounds.append({v: max(t[v] for t in per_rank) for v in VARIANTS})

    rate = {v: [images / rnd[v] for rnd in rounds] for v in VARIANTS}  # per rank, per round
    where = f"GPU ({gpu_name})" if gpu_name else "CPU"
    print(f"\n{args.model}, batch {args.batch_size} per rank, {args.image_size}x{args.image_size} "
          f"random images, SGD lr 0.01; np={args.np}, {where}; {args.warmup} warm-up batches, "
          f"then {args.iters} iterations of {args.batches_per_iter} batches per variant, "
          "interleaved iteration by iteration (slowest rank's time).")
    print(f"{'variant':<8}{'img/s per rank':>22}{'median':>10}{'total img/s':>24}"
          f"{'peak memory':>14}")
    for v in VARIANTS:
        mean, conf = mean_conf(rate[v])
        peak = "n/a (CPU)" if peaks[v] is None else f"{peaks[v] / 2**30:.2f} GiB"
        per_rank = f"{mean:.1f} +- {conf:.1f}"
        total = f"{args.np * mean:.1f} +- {args.np * conf:.1f}"
        print(f"{v:<8}{per_rank:>22}{statistics.median(rate[v]):>10.1f}{total:>24}{peak:>14}")
    ratios = {}
    for other in ("plain", "ddp"):
        ratios[other] = statistics.fmean(rate["hvd"]) / statistics.fmean(rate[other])
        paired = statistics.median(h / o for h, o in zip(rate["hvd"], rate[other]))
        print(f"hvd/{other:<6} {ratios[other]:.3f}x images/s (median of per-round ratios "
              f"{paired:.3f}x)")
    if not gpu_name:
        print(f"Target (hvd >= {GPU_TARGET}x plain at np=1 on a GPU): not measured here, the "
              "CPU figures are informative")
        return 0
    if args.np != 1:
        print(f"Target (hvd >= {GPU_TARGET}x plain at np=1 on a GPU): measured at np=1 only "
              "(--np 1)")
        return 0
    ok = ratios["plain"] >= GPU_TARGET
    print(f"Target (hvd >= {GPU_TARGET}x plain at np=1 on a GPU): {'met' if ok else 'not met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
