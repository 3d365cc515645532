"""What keeping the cells' output in the kernel (for a page that opens the notebook again:
``ipydist.notebook.reopen``) costs a training loop: step time with the keeping on against off,
in one kernel, the two interleaved, through a real Jupyter kernel (jupyter_client, which reads
every message as a page would).

The worst case for it: each step prints a line on every rank and logs a point, so the kernel
sends a stream message and a chart update about every step, each through the keeper. On this
2-core machine the kernel shares the cores with the ranks, so its side counts.

Printed: median ms per step of each variant, and the ratio (the bar: at most 1.02x).

    .venv/bin/python benchmarks/kept_output.py [--np 2] [--rounds 8] [--steps 400]
"""

from __future__ import annotations

import argparse
import re
import statistics

from cluster_view import run  # (a cell through the kernel; what it printed)
from jupyter_client.manager import start_new_kernel

SETUP = """%%everyrank
import time, torch, ipydist.torch as hvd
torch.manual_seed(hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
def train(steps):
    t0 = time.perf_counter()
    for i in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        opt.step()
        print(f"step {i} loss {loss.item():.4f}")
        hvd.log(step=i, total=steps, loss=loss.item())
    return (time.perf_counter() - t0) / steps
"""
KEEPER = "_keeper = get_ipython().kernel._ipydist_keeper"


def step_ms(kc, steps: int) -> float:
    text = run(kc, f"%%everyrank\nstep_s = train({steps})\nif hvd.rank() == 0:\n"
               "    print('STEP', step_s)")
    return float(re.search(r"STEP ([0-9.e-]+)", text).group(1)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    km, kc = start_new_kernel(kernel_name="python3")
    times: dict[str, list[float]] = {"kept": [], "not kept": []}
    try:
        run(kc, f"%load_ext ipydist\n%dist_start --np {args.np}")
        run(kc, SETUP)
        run(kc, KEEPER)
        step_ms(kc, args.steps // 4)  # warm up
        for _ in range(args.rounds):
            for name in times:
                run(kc, f"_keeper.enabled = {name == 'kept'}")
                times[name].append(step_ms(kc, args.steps))
        kept = run(kc, "print(sum(len(c['outputs']) for c in _keeper.cells()))")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    base = statistics.median(times["not kept"])
    print(f"np={args.np}, {args.rounds} rounds of {args.steps} steps (a line printed and a point "
          f"logged each), interleaved; {kept.strip()} outputs kept")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<10} {median:7.3f} ms/step   {median / base:5.3f}x not kept")


if __name__ == "__main__":
    main()
