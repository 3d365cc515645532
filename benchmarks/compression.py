"""Bytes each rank sends per step, and step time, for fp32, fp16, 1-bit SGD, PowerSGD and block
momentum.

One model of 1.6 M parameters (an MLP of three large layers; ``--model cnn``: notebook 06's
digits CNN, 38 K parameters, where issue 69's PowerSGD bars are set), the same data and ranks
in one run, the variants interleaved round by round:

- ``fp32``: ``DistributedOptimizer`` (``Compression.none``): an allreduce of float32 gradients;
- ``fp16``: the same with ``Compression.fp16``;
- ``1-bit``: ``Compression.onebit``: 1-bit messages with error feedback, by stripes (an
  all-to-all to each stripe's owner, then an allgather of the owners' sums);
- ``powersgd``: ``Compression.powersgd(rank=4, start_iter=0)``: each weight matrix as two thin
  matrices of 4 columns (two allreduces), with error feedback and a warm-started Q;
- ``bmuf``: ``BlockMomentum(block_steps=BLOCK)``: one allreduce of the model per block.

Bytes are the optimizers' own count (``optimizer.bytes_sent``): every buffer a rank hands to
MPI (or gloo), as the bytes it sends under the bandwidth-optimal algorithms (an allreduce of n
bytes: 2 (N-1)/N x n, as ring or reduce-scatter plus allgather; an all-to-all of N rows of m
bytes: (N-1) x m; an allgather of an m-byte message from every rank: (N-1) x m). The
collectives' small agreement headers are not counted. Targets: 1-bit sends at least 20x
fewer bytes than fp32, bmuf at least BLOCK times fewer, and a 1-bit step takes at most 1.5x an
fp32 step on one host (where the quantization is all cost: shared memory moves the fp32
gradients in a few milliseconds); PowerSGD sends at least 8x fewer bytes, a step at most 1.5x
fp32's (issue 69's bars, which notebook 06 holds on the digits CNN).

    .venv/bin/python benchmarks/compression.py [--np 2] [--steps 32] [--rounds 9] [--model cnn]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap

import ipydist

BLOCK = 8

RANK_CODE = textwrap.dedent('''
    import time, torch
    import ipydist.torch as hvd

    MODEL = "mlp"

    def make_model():
        torch.manual_seed(0)
        nn = torch.nn
        if MODEL == "cnn":  # notebook 06's digits CNN
            return nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                nn.Linear(64, 10))
        return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))

    def wrap(variant, model):
        """The model to call and its optimizer, for ``variant``."""
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if variant == "bmuf":
            return model, hvd.BlockMomentum(opt, block_steps=BLOCK)
        compression = {"fp32": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                       "1-bit": hvd.Compression.onebit,
                       "powersgd": hvd.Compression.powersgd(rank=4, start_iter=0)}[variant]
        return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               compression=compression)

    def time_variant(variant, steps):
        model, opt = wrap(variant, make_model())
        x = torch.randn(32, 1, 8, 8) if MODEL == "cnn" else torch.randn(32, 512)
        y = torch.randint(0, 10, (32,))
        loss_fn = torch.nn.CrossEntropyLoss()

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        for _ in range(BLOCK):
            step()
        hvd.barrier()
        before = getattr(opt, "bytes_sent", 0)  # a torch optimizer (benchmarks/links.py) sends none
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = (time.perf_counter() - t0) / steps
        wire = (getattr(opt, "bytes_sent", 0) - before) / steps
        params = sum(p.numel() for p in model.parameters())
        # the slowest rank sets the pace of synchronous training
        return hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max).item(), wire, params
''')

VARIANTS = ["fp32", "fp16", "1-bit", "powersgd", "bmuf"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4 * BLOCK)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    args = parser.parse_args(argv)
    if args.steps % BLOCK:
        parser.error(f"--steps must be a multiple of the block size, {BLOCK}")

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    wire: dict[str, float] = {}
    with ipydist.Session(np=args.np, gpus="none") as s:
        s.run(RANK_CODE.replace("BLOCK", str(BLOCK)))
        s.run(f"MODEL = {args.model!r}")
        for r in range(args.rounds):
            for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                s.run(f"t = time_variant({variant!r}, {args.steps})", output="rank0")
                seconds, wire[variant], params = s.pull("t", rank=0)
                times[variant].append(seconds)
    med = {v: statistics.median(t) * 1e3 for v, t in times.items()}

    print(f"\nCPU, np={args.np}, {args.model}, {params / 1e6:.2f} M parameters, median of "
          f"{args.rounds} rounds of {args.steps} steps; bmuf: block_steps={BLOCK}. Bytes: what "
          "each rank sends per step (transport.bytes_sent's model).")
    print(f"{'variant':<9}{'ms/step':>10}{'x fp32':>8}{'KB sent/step':>15}{'fewer than fp32':>17}")
    for v in VARIANTS:
        print(f"{v:<9}{med[v]:>10.2f}{med[v] / med['fp32']:>7.2f}x{wire[v] / 1e3:>15.1f}"
              f"{wire['fp32'] / wire[v]:>16.1f}x")
    ok = (wire["fp32"] / wire["1-bit"] >= 20 and wire["fp32"] / wire["bmuf"] >= BLOCK
          and med["1-bit"] <= 1.5 * med["fp32"] and wire["fp32"] / wire["powersgd"] >= 8
          and med["powersgd"] <= 1.5 * med["fp32"])
    print(f"\ntargets (1-bit >= 20x fewer bytes than fp32, bmuf >= {BLOCK}x fewer, 1-bit step "
          f"<= 1.5x fp32's; powersgd >= 8x fewer bytes, its step <= 1.5x fp32's): "
          f"{'met' if ok else 'not met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
