"""What the live cluster view (``%dist_status --live``) costs a training loop: its step time
with a view open against every view closed, and against the ranks' vitals turned off too,
through a real Jupyter kernel (jupyter_client; the widget's messages travel to it as to a
front end), the three variants interleaved.

The ranks send their vitals once a second while a cell runs whatever the notebook shows;
an open view adds the notebook's refresh (its thread, psutil readings of local ranks, one
widget update a second). On this 2-core machine the notebook shares the cores with the ranks,
so the notebook's side counts too.

Printed: median ms per step of each variant, and the ratios.

    .venv/bin/python benchmarks/cluster_view.py [--np 4] [--rounds 6] [--steps 1500]
"""

from __future__ import annotations

import argparse
import re
import statistics

from jupyter_client.manager import start_new_kernel

SETUP = """%%everyrank
import time, torch, ipydist.torch as hvd
import ipydist.rank.vitals as vitals
torch.manual_seed(hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
def train(steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
    return (time.perf_counter() - t0) / steps
"""
MONITOR = "_monitor = get_ipython().magics_manager.registry['DistMagics'].session.monitor"
CLOSE = "for _v in _monitor._open_views(): _v.close()"
OPEN = "_view = _monitor.open_view()"


def run(kc, code: str) -> str:
    printed = []

    def hook(msg):
        if msg["header"]["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=900, output_hook=hook)
    assert reply["content"]["status"] == "ok", (code, reply["content"])
    return "".join(printed)


def step_ms(kc, steps: int) -> float:
    text = run(kc, f"%%everyrank --output rank0\nprint('STEP', train({steps}))")
    return float(re.search(r"STEP ([0-9.e-]+)", text).group(1)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    km, kc = start_new_kernel(kernel_name="python3")
    times: dict[str, list[float]] = {"view open": [], "views closed": [],
                                     "views closed, vitals off": []}
    try:
        run(kc, f"%load_ext ipydist\n%dist_start --np {args.np}")
        run(kc, SETUP)
        run(kc, MONITOR)
        step_ms(kc, args.steps // 3)  # warm up
        for _ in range(args.rounds):
            for name in times:
                run(kc, OPEN if name == "view open" else CLOSE)
                off = name.endswith("vitals off")
                run(kc, f"%%everyrank\nvitals.enabled = {not off}")
                times[name].append(step_ms(kc, args.steps))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    base = statistics.median(times["views closed"])
    print(f"np={args.np}, {args.rounds} rounds of {args.steps} steps, interleaved")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<26} {median:7.3f} ms/step   {median / base:5.3f}x views closed")


if __name__ == "__main__":
    main()
