"""What ``--elastic`` costs, and how fast it heals.

1. Allreduce with Open MPI's fault tolerance (ULFM, ``--elastic``) against without, per size:
   the two kinds of cluster alternate (a cluster cannot switch), each pass timing
   ``hvd.allreduce_`` (ipydist's transport, call check and waits) and raw mpi4py
   ``Allreduce`` on every size; printed: medians over passes of elastic / plain. The bar for
   ``--elastic`` to be on by default: at most 1.10x at 1 MB and above.
2. Heals: on one elastic cluster with a model and its DistributedOptimizer, a rank is
   SIGKILLed while the others run allreduces, again and again (a replacement of a replacement
   too); printed: the seconds from the kill to the end of the cell and to the end of the
   next cell, which waits for the heal and checks the parameters identical.
3. ``Session.scale``: np -> np/2 -> np, a few times; the seconds each way.

    .venv/bin/python benchmarks/elastic.py [--np 4] [--passes 5] [--heals 5] [--scales 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

from allreduce import RANK_CODE, SIZES, label

import ipydist
from ipydist.errors import RankDied

VARIANTS = ["ipydist", "mpi"]
MODEL = """
import torch, ipydist.torch as hvd
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
def step():
    opt.zero_grad()
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()
def identical():
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return bool(hvd.allreduce(flat, op=hvd.Max).equal(hvd.allreduce(flat, op=hvd.Min)))
step()
"""


def allreduce_pass(np: int, elastic: bool, rounds: int) -> dict:
    times: dict = {}
    with ipydist.Session(np=np, gpus="none", elastic=elastic) as s:
        s.run(RANK_CODE, output="rank0")
        for r in range(rounds):
            for size in SIZES:
                for variant in VARIANTS[r % 2:] + VARIANTS[:r % 2]:
                    s.run(f"sec = time_allreduce({variant!r}, {size})", output="rank0")
                    times.setdefault((size, variant), []).append(s.pull("sec", rank=0))
    return {k: statistics.median(v) for k, v in times.items()}


def cost(np: int, passes: int) -> bool:
    per: dict = {}
    for p in range(passes):
        for elastic in ([True, False] if p % 2 == 0 else [False, True]):
            for k, v in allreduce_pass(np, elastic, 2).items():
                per.setdefault((elastic, *k), []).append(v)
    med = {k: statistics.median(v) for k, v in per.items()}
    print(f"\nnp={np}, CPU float32, one host; median of {passes} passes of each kind "
          "(alternating), ms per call (slowest rank)")
    print(f"{'size':>7} {'ipydist plain':>14} {'elastic':>9} {'ratio':>7}   "
          f"{'raw mpi plain':>14} {'elastic':>9} {'ratio':>7}")
    ok = True
    for size in SIZES:
        row = []
        for variant in VARIANTS:
            plain, el = med[(False, size, variant)] * 1e3, med[(True, size, variant)] * 1e3
            row.append((plain, el, el / plain))
        if size >= 1 << 20:
            ok &= row[0][2] <= 1.10
        print(f"{label(size):>7} {row[0][0]:>14.3f} {row[0][1]:>9.3f} {row[0][2]:>6.2f}x   "
              f"{row[1][0]:>14.3f} {row[1][1]:>9.3f} {row[1][2]:>6.2f}x")
    print(f"bar (elastic ipydist at most 1.10x plain at 1 MB and above): "
          f"{'met' if ok else 'not met'}")
    return ok


def heals(np: int, count: int) -> None:
    ended, healed = [], []
    with ipydist.Session(np=np, gpus="none", elastic=True) as s:
        s.run(MODEL, output="rank0")
        for i in range(count):
            victim = 1 + i % (np - 1)
            killed: list[float] = []

            def kill(pid=s.ranks[victim]["pid"], killed=killed):
                killed.append(time.time())
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(1.0, kill)
            timer.start()
            try:
                s.run("t = torch.ones(1000)\nwhile True:\n    hvd.allreduce_(t)", output="rank0")
            except RankDied:
                pass
            ended.append(time.time() - killed[0])
            timer.join()
            s.run("step()\nsame = identical()", output="rank0")
            healed.append(time.time() - killed[0])
            assert s.pull("same") == [True] * np
    print(f"\n{count} heals on np={np} (rank 1..{np - 1} in turn SIGKILLed mid-allreduce): "
          f"cell ended {statistics.median(ended):.2f} s after the kill (max {max(ended):.2f}), "
          f"healed and the next cell done {statistics.median(healed):.2f} s after it "
          f"(max {max(healed):.2f}); parameters identical after each")


def scales(np: int, count: int) -> None:
    """``Session.scale`` np -> np/2 -> np, ``count`` times, a DistributedOptimizer on board."""
    down, up = [], []
    with ipydist.Session(np=np, gpus="none", elastic=True) as s:
        s.run(MODEL, output="rank0")
        for _ in range(count):
            t0 = time.perf_counter()
            s.scale(np // 2)
            down.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.scale(np)
            up.append(time.perf_counter() - t0)
            s.run("step()\nsame = identical()", output="rank0")
            assert s.pull("same") == [True] * np
    print(f"\n{count} times np={np} -> {np // 2} -> {np}: shrinking took "
          f"{statistics.median(down):.2f} s (median), growing {statistics.median(up):.2f} s "
          f"(spawned ranks importing torch, rank 0's variables copied); parameters identical")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--heals", type=int, default=5)
    parser.add_argument("--scales", type=int, default=3)
    args = parser.parse_args(argv)
    ok = cost(args.np, args.passes) if args.passes else True
    if args.heals:
        heals(args.np, args.heals)
    if args.scales:
        scales(args.np, args.scales)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
