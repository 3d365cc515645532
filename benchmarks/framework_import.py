"""What ipydist adds to a cell that imports Lightning or transformers on a rank.

On a rank, ipydist watches for Lightning's import (a finder on ``sys.meta_path``:
``ipydist.rank.frameworks``) and adjusts its registries once it has run; the live-chart
integrations (``ipydist.integrations.lightning.LiveLogger``,
``ipydist.integrations.hf.LiveMetrics``) are imported by the user's cell. Each variant runs
in a fresh Python process with torch already imported (a rank has it before the first cell),
timing from just before the framework's import to just after:

- ``plain``: ``import lightning.pytorch`` (or ``from transformers import Trainer, ...``), with
  ipydist's module imported but its finder not installed;
- ``ipydist``: the same with ipydist's finder installed, then the integration imported too.

Variants alternate in ABBA order round by round, so machine load hits both alike; the medians
and their ratio are printed. Target: ``ipydist`` <= 1.05x ``plain`` (the finder and the
integrations import nothing heavy; the adjustment is a few registry entries).

    .venv/bin/python benchmarks/framework_import.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

FRAMEWORKS = {
    "lightning": ("import lightning.pytorch",
                  "from ipydist.integrations.lightning import LiveLogger"),
    "transformers": ("from transformers import Trainer, TrainingArguments",
                     "from ipydist.integrations.hf import LiveMetrics"),
}

PROGRAM = """
import os, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
{setup}
t0 = time.perf_counter()
{timed}
print(time.perf_counter() - t0)
"""


def one(framework: str, variant: str) -> float:
    imports, integration = FRAMEWORKS[framework]
    # both import ipydist's module first (on a rank it is loaded anyway), so what ipydist's
    # package itself imports is outside the timed part of each
    setup = "from ipydist.rank import frameworks"
    if variant == "plain":
        timed = imports
    else:
        setup += "; frameworks.install(2)"
        timed = f"{imports}\n{integration}"
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(setup=setup, timed=timed)],
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    print(f"{'framework':<13} {'plain s':>8} {'ipydist s':>10} {'ratio':>6}   (medians of "
          f"{args.rounds}, ABBA)")
    for framework in FRAMEWORKS:
        times: dict[str, list[float]] = {"plain": [], "ipydist": []}
        for r in range(args.rounds):
            order = ("plain", "ipydist") if r % 2 == 0 else ("ipydist", "plain")
            for variant in order:
                times[variant].append(one(framework, variant))
        plain, hooked = (statistics.median(times[v]) for v in ("plain", "ipydist"))
        print(f"{framework:<13} {plain:>8.3f} {hooked:>10.3f} {hooked / plain:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
