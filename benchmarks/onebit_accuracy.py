"""Which 1-bit quantizer trains with momentum: the measurement behind ``onebit.GROUP`` and the
momentum correction (``ipydist.torch.training.gradients.momentum_correction``).

Four ranks are emulated in one process with the real arithmetic of the exchange (each rank's
``quantize_stripes`` with its residual, each owner's ``requantize_stripe`` with its own, every
rank's ``assemble``): synchronous data-parallel SGD on scikit-learn's digits, 32 samples per
rank per step, SGD with momentum 0.9 at the learning rate full precision uses, several seeds.
Variants: groups of 512, 128 and 64 values, with momentum applied to the decoded average (as a
plain ``torch.optim.SGD`` after the exchange) or kept per rank before the quantizer (the
correction). Full precision is the same loop with an exact average. An emulation, not ranks:
it runs in a minute or two and isolates the arithmetic (the cluster tests and notebook 06 hold
the real ranks to the bar).

    .venv/bin/python benchmarks/onebit_accuracy.py [--epochs 30] [--seeds 4] [--model both]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from ipydist.torch.training.gradients import momentum_correction, onebit

WORLD, BATCH, MOMENTUM = 4, 32, 0.9
#: Full precision's learning rate per model (the CNN is unstable at 0.1 on some seeds).
LR = {"mlp": 0.1, "cnn": 0.05}


def data():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return train_test_split(x, torch.tensor(digits.target), test_size=0.25, random_state=0)


def make_model(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    nn = torch.nn
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64),
                         nn.ReLU(), nn.Linear(64, 10))


class Exchange:
    """The 1-bit exchange of one flat bucket among WORLD emulated ranks."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.residuals = [torch.zeros(numel) for _ in range(WORLD)]
        self.owner = [torch.zeros(stop - start) for start, stop in onebit.stripes(numel, WORLD)]

    def sum(self, sent: list[torch.Tensor]) -> torch.Tensor:
        flags = torch.ones(1)
        outs = [torch.empty(self.numel) for _ in range(WORLD)]
        sends = [onebit.quantize_stripes(x, flags, r, out, WORLD)
                 for x, r, out in zip(sent, self.residuals, outs)]
        self.residuals = outs
        gathered = []
        for j, (start, stop) in enumerate(onebit.stripes(self.numel, WORLD)):
            new = torch.empty(stop - start)
            gathered.append(onebit.requantize_stripe(
                torch.stack([s[j] for s in sends]), stop - start, 1, self.owner[j], new))
            self.owner[j] = new
        return onebit.assemble(torch.stack(gathered), self.numel, 1)[0].clone()


def train(kind: str, seed: int, variant: str, epochs: int, split) -> float:
    x_train, x_test, y_train, y_test = split
    model = make_model(kind, seed)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    opt = torch.optim.SGD(params, lr=LR[kind], momentum=MOMENTUM)
    exchange = Exchange(numel) if variant != "fp32" else None
    corrections = ([momentum_correction.MomentumCorrection(params, opt, 1.0)
                    for _ in range(WORLD)] if variant.endswith("before") else None)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(
            seed * 1000 + epoch))
        shards = [order[r::WORLD] for r in range(WORLD)]
        for b in range(-(-len(shards[0]) // BATCH)):
            sent = []
            for r in range(WORLD):
                idx = shards[r][b * BATCH:(b + 1) * BATCH]
                model.zero_grad()
                loss_fn(model(x_train[idx]), y_train[idx]).backward()
                flat = torch.cat([p.grad.reshape(-1) for p in params]) / WORLD
                if corrections:
                    flat = corrections[r].apply(flat).clone()
                sent.append(flat)
            total = torch.stack(sent).sum(0) if exchange is None else exchange.sum(sent)
            for p, piece in zip(params, total.split([p.numel() for p in params])):
                p.grad = piece.view_as(p).clone()
            if corrections:
                with momentum_correction.plain_step(opt):
                    opt.step()
                for c in corrections:
                    c.commit()
            else:
                opt.step()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--model", choices=["mlp", "cnn", "both"], default="both")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    split = data()
    built = onebit.GROUP
    variants = ["fp32"] + [f"{g}, momentum {where}" for g in (512, 128, 64)
                           for where in ("after", "before")]
    print(f"{WORLD} emulated ranks, SGD momentum {MOMENTUM}, {args.epochs} epochs, mean and "
          f"spread of {args.seeds} seeds; 1-bit levels in bfloat16 (bits per value: "
          "1 + 32 / group)")
    print(f"{'model':<6}{'variant':<22}{'lr':>6}{'accuracy':>10}{'spread':>8}{'vs fp32':>9}")
    for kind in (["mlp", "cnn"] if args.model == "both" else [args.model]):
        full = None
        for variant in variants:
            onebit.GROUP = int(variant.split(",")[0]) if variant != "fp32" else built
            accs = [train(kind, s, variant, args.epochs, split) for s in range(args.seeds)]
            mean, spread = statistics.mean(accs), statistics.stdev(accs)
            full = mean if full is None else full
            print(f"{kind:<6}{variant:<22}{LR[kind]:>6}{mean:>10.4f}{spread:>8.4f}"
                  f"{100 * (mean - full):>+8.1f}p", flush=True)
    onebit.GROUP = built
    return 0


if __name__ == "__main__":
    sys.exit(main())
