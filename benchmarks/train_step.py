"""Step time of DistributedOptimizer and DDP, on gloo and on MPI, against no exchange at all.

Same model, data and ranks in one run, variants interleaved round by round so that machine
load hits them alike:

- ``floor``: each rank trains alone, no gradient exchange (what communication costs nothing);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the default gloo group;
- ``ddp-mpi``: the same DDP on a group of ipydist's MPI backend (what ``--backend mpi`` gives);
- ``hvd``: ``ipydist.torch.DistributedOptimizer`` (default buckets) on the transport it chose
  (MPI under mpiexec), plus a sweep of bucket sizes that chose the default;
- ``hvd-gloo``: the same with ``--transport gloo``.

Two models: a small MLP of many small tensors (latency-bound) and a model of a few large tensors
(bandwidth-bound). Targets on CPU: on the large model, the communication overhead (step minus
floor) of hvd and of ddp-mpi at most half of ddp's; on the small one, hvd <= 1.0x ddp; and
one rank alone: hvd <= 1.03x the plain optimizer (a world of one has nothing to exchange). On
a machine with GPUs, it also measures DistributedOptimizer at np=1 against plain single-GPU
training (target <= 1.03x), at np=1..N against DDP on NCCL (target <= 1.0x), and 2 ranks
sharing GPU 0 against DDP sharing it the same way, with a third model of 48 tensors of 4 MB
(buckets of DDP's size matter there).

    .venv/bin/python benchmarks/train_step.py [--np 2] [--steps 30] [--rounds 5]
    .venv/bin/python benchmarks/train_step.py --gpu-only   # the GPU section alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap

import ipydist

RANK_CODE = textwrap.dedent('''
    import time, torch, torch.distributed as dist
    import ipydist.torch as hvd
    from torch.nn.parallel import DistributedDataParallel as DDP

    _mpi_group = None

    def make_model(kind):
        torch.manual_seed(0)
        if kind == "bert-like":   # GPU only: 48 tensors of 4 MB and 48 small ones (~200 MB)
            layers = []
            for _ in range(48):
                layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
            return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)), (64, 1024)
        if kind == "small-mlp":   # 40 tensors of 64x64 or 64: many small allreduces
            layers = []
            for _ in range(20):
                layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
            return torch.nn.Sequential(*layers, torch.nn.Linear(64, 10)), (32, 64)
        # 3 tensors of 1536x1536 (~28 MB of gradients): bandwidth-bound
        return torch.nn.Sequential(
            torch.nn.Linear(512, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 1536),
            torch.nn.ReLU(), torch.nn.Linear(1536, 1536), torch.nn.ReLU(),
            torch.nn.Linear(1536, 10)), (16, 512)

    def time_variant(kind, variant, steps, bucket_mb=None):
        from ipydist.torch._core import topology
        wire = topology.get().transport
        topology.get().transport = "gloo" if variant.endswith("-gloo") else wire
        try:
            return _time_variant(kind, variant.removesuffix("-gloo"), steps, bucket_mb)
        finally:
            topology.get().transport = wire

    def _time_variant(kind, variant, steps, bucket_mb=None):
        model, (batch, width) = make_model(kind)
        model = model.to(hvd.device())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if variant == "ddp":
            model = DDP(model)
        elif variant == "ddp-mpi":  # the same DDP on ipydist's MPI backend (--backend mpi)
            global _mpi_group
            _mpi_group = _mpi_group or dist.new_group(backend="mpi4py")
            model = DDP(model, process_group=_mpi_group)
        elif variant == "hvd":
            kwargs = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           **kwargs)
        x = torch.randn(batch, width, device=hvd.device())
        y = torch.randint(0, 10, (batch,), device=hvd.device())
        loss_fn = torch.nn.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        hvd.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - t0) / steps
        # the slowest rank sets the pace of synchronous training
        return hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max).item()
''')

VARIANTS = [("floor", None), ("ddp", None), ("ddp-mpi", None), ("hvd", None), ("hvd-gloo", None)]
#: The small model's steps are ten times quicker; more of them keep its medians as steady.
STEPS_FACTOR = {"small-mlp": 8, "large-tensors": 1, "bert-like": 1}
BUCKET_SWEEP = [1, 4, 25, 100]


def measure(session, kinds, variants, steps: int, rounds: int) -> dict:
    """Median seconds per step for each (kind, variant, bucket), over rounds in rotating order."""
    times: dict = {}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for kind in kinds:
            for variant, bucket in order:
                n = steps * STEPS_FACTOR[kind]
                session.run(
                    f"t = time_variant({kind!r}, {variant!r}, {n}, {bucket!r})",
                    output="rank0",
                )
                times.setdefault((kind, variant, bucket), []).append(session.pull("t", rank=0))
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    kinds = ["small-mlp", "large-tensors"]

    with ipydist.Session(np=args.np, gpus="none") as s:
        s.run(RANK_CODE)
        variants = VARIANTS + [("hvd", mb) for mb in BUCKET_SWEEP]
        med = measure(s, kinds, variants, args.steps, args.rounds)

    print(f"\nCPU, np={args.np}, median of {args.rounds} rounds of {args.steps} steps "
          f"({args.steps * STEPS_FACTOR['small-mlp']} for small-mlp); ms per step, slowest rank.")
    print("ddp: DDP on gloo; ddp-mpi: DDP on --backend mpi; hvd: DistributedOptimizer on its "
          "chosen transport (MPI); hvd-gloo: the same on gloo. Overhead: step minus floor, as a "
          "share of ddp's.")
    names = [v for v, _ in VARIANTS]
    print(f"{'model':<14}" + "".join(f"{v:>10}" for v in names)
          + f"{'hvd/ddp':>9}{'ovh hvd':>9}{'ovh ddp-mpi':>12}")
    ok = True
    for kind in kinds:
        ms = {v: med[(kind, v, None)] * 1e3 for v in names}
        over = {v: (ms[v] - ms["floor"]) / (ms["ddp"] - ms["floor"]) for v in ("hvd", "ddp-mpi")}
        if kind == "large-tensors":  # the bar: at most half of DDP-on-gloo's overhead
            ok &= over["hvd"] <= 0.5 and over["ddp-mpi"] <= 0.5
        else:  # many small tensors: no slower than DDP on gloo
            ok &= ms["hvd"] <= ms["ddp"]
        print(f"{kind:<14}" + "".join(f"{ms[v]:>10.2f}" for v in names)
              + f"{ms['hvd'] / ms['ddp']:>8.2f}x{over['hvd']:>9.2f}{over['ddp-mpi']:>12.2f}")
    print("\nbucket_cap_mb sweep (hvd ms per step):")
    print(f"{'model':<14}" + "".join(f"{mb:>8} MB" for mb in BUCKET_SWEEP))
    for kind in kinds:
        print(f"{kind:<14}" + "".join(f"{med[(kind, 'hvd', mb)] * 1e3:>11.2f}"
                                      for mb in BUCKET_SWEEP))
    print("\nCPU targets (large-tensors: hvd and ddp-mpi overhead <= 0.5 of ddp's; small-mlp: "
          f"hvd <= 1.0x ddp): {'met' if ok else 'not met'}")
    ok &= one_rank_overhead(args.steps, args.rounds)
    gpu_ok = gpu_overhead(args.steps, args.rounds)
    return 0 if ok and gpu_ok is not False else 1


def one_rank_overhead(steps: int, rounds: int) -> bool:
    """One rank on the CPU: DistributedOptimizer against the plain optimizer (target <= 1.03x,
    the GPU's np=1 bar): a world of one has nothing to exchange."""
    kinds = ["small-mlp", "large-tensors"]
    with ipydist.Session(np=1, gpus="none") as s:
        s.run(RANK_CODE)
        med = measure(s, kinds, [("floor", None), ("hvd", None)], steps, rounds)
    ok = True
    print(f"\nCPU, np=1, median of {rounds} rounds; ms per step.")
    print(f"{'model':<14}{'plain':>9}{'hvd':>9}{'hvd/plain':>11}")
    for kind in kinds:
        floor, hvd = med[(kind, "floor", None)], med[(kind, "hvd", None)]
        ok &= hvd <= 1.03 * floor
        print(f"{kind:<14}{floor * 1e3:>9.2f}{hvd * 1e3:>9.2f}{hvd / floor:>10.3f}x")
    print(f"CPU target at np=1 (hvd <= 1.03x plain): {'met' if ok else 'not met'}")
    return ok


def gpu_overhead(steps: int, rounds: int) -> bool | None:
    """On the GPUs of this host (None: none here): DistributedOptimizer at np=1 against plain
    training (target <= 1.03x), and at np=1..N against DDP on NCCL (target <= 1.0x)."""
    import torch

    if not torch.cuda.is_available():
        print("GPU targets (hvd <= 1.03x plain at np=1, <= 1.0x ddp at np=1..N): not "
              "measured, no CUDA GPU here")
        return None
    kinds = ["small-mlp", "large-tensors", "bert-like"]
    ok = True
    print(f"\nGPU, median of {rounds} rounds of {steps} steps; ms per step, slowest rank.")
    print(f"{'np':>3} {'model':<14}{'floor':>9}{'ddp':>9}{'hvd':>9}{'hvd/floor':>11}"
          f"{'hvd/ddp':>9}")
    # one rank per GPU, then 2 ranks sharing GPU 0 (DDP sharing it the same way beside them)
    runs = [(n, "auto") for n in range(1, torch.cuda.device_count() + 1)] + [(2, "0")]
    for n, gpus in runs:
        with ipydist.Session(np=n, gpus=gpus) as s:
            s.run(RANK_CODE)
            way = s.ranks[0]["gpu_sharing"]
            med = measure(s, kinds, [("floor", None), ("ddp", None), ("hvd", None)], steps,
                          rounds)
        label = f"{n}/1" if gpus == "0" else str(n)
        for kind in kinds:
            floor, ddp, hvd = (med[(kind, v, None)] for v in ("floor", "ddp", "hvd"))
            ok &= hvd <= ddp and (n > 1 or hvd <= 1.03 * floor)
            print(f"{label:>3} {kind:<14}{floor * 1e3:>9.2f}{ddp * 1e3:>9.2f}{hvd * 1e3:>9.2f}"
                  f"{hvd / floor:>10.3f}x{hvd / ddp:>8.3f}x" + (f"  (share by {way})"
                                                                 if way else ""))
    print("np 2/1: two ranks sharing GPU 0. GPU targets (hvd <= 1.03x plain at np=1, <= 1.0x "
          f"ddp at np=1..N and sharing): {'met' if ok else 'not met'}")
    return ok


def gpu_only(argv: list[str] | None = None) -> int:
    """``--gpu-only``: the GPU section alone (on a machine lent for minutes)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    return 0 if gpu_overhead(args.steps, args.rounds) is not False else 1


if __name__ == "__main__":
    if "--gpu-only" in sys.argv:
        sys.exit(gpu_only([a for a in sys.argv[1:] if a != "--gpu-only"]))
    sys.exit(main())
