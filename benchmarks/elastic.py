"""What ``--elastic`` costs, and how fast it heals, with and without hot spares.

1. Allreduce with Open MPI's fault tolerance (ULFM) against a plain cluster
   (``--no-elastic``), per size. The elastic one is as one host's default makes it, with
   ``--spares`` as given (MPI shared memory only), or with ``--spares 0`` as ``--elastic
   --spares 0`` makes it (TCP beside shared memory, for spawns). The two kinds of cluster
   alternate (a cluster cannot switch), each left alone for 3 s after its start, then each
   pass times ``hvd.allreduce_`` (ipydist's transport, call check and waits) and raw mpi4py
   ``Allreduce`` on every size; printed: medians over passes of elastic / plain. The bar for
   elastic to be on by default: at most 1.10x at 1 MB and above.
2. Starts: a plain cluster against one host's default (elastic, one hot spare), alternating;
   printed:
   the medians of the seconds to a ready cluster, and the memory of its own a spare holds.
3. Heals with a spare against heals by a spawn, alternating, each on a fresh cluster with a
   model and its DistributedOptimizer: a rank is SIGKILLed while the others run allreduces;
   printed: the seconds from the kill to the end of the cell and to the end of the next cell,
   which waits for the heal and checks the parameters identical (bar for spares: the next
   cell done within 1.5 s of the kill, median). Then, on one cluster, heal after heal (a
   replacement of a replacement too) by spawns.
4. ``Session.scale``: np -> np/2 -> np, a few times; the seconds each way.

    .venv/bin/python benchmarks/elastic.py [--np 4] [--spares 0] [--passes 5] [--starts 5]
                                           [--heals 5] [--scales 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time

import psutil
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


def allreduce_pass(np: int, elastic: bool, rounds: int, spares: int = 0) -> dict:
    """One cluster's medians: plain (``--no-elastic``), or elastic as one host's default
    makes it with ``spares`` (shared memory only), or with none (``--elastic --spares 0``:
    MPI's TCP transport beside shared memory, for spawns)."""
    times: dict = {}
    options = (dict(elastic=False) if not elastic else dict(spares=spares) if spares
               else dict(elastic=True, spares=0))
    with ipydist.Session(np=np, gpus="none", **options) as s:
        s.run(RANK_CODE, output="rank0")
        time.sleep(SETTLE_SECONDS)
        for r in range(rounds):
            for size in SIZES:
                for variant in VARIANTS[r % 2:] + VARIANTS[:r % 2]:
                    s.run(f"sec = time_allreduce({variant!r}, {size})", output="rank0")
                    times.setdefault((size, variant), []).append(s.pull("sec", rank=0))
    return {k: statistics.median(v) for k, v in times.items()}


#: Seconds a new cluster is left alone before it is timed, for either kind: what a start
#: leaves running in the background ends (a hot spare's warm-up import, at idle priority).
SETTLE_SECONDS = 3.0


def cost(np: int, passes: int, spares: int) -> bool:
    per: dict = {}
    for p in range(passes):
        for elastic in ([True, False] if p % 2 == 0 else [False, True]):
            for k, v in allreduce_pass(np, elastic, 2, spares).items():
                per.setdefault((elastic, *k), []).append(v)
    med = {k: statistics.median(v) for k, v in per.items()}
    kind = f"--spares {spares} (the default's kind)" if spares else "--elastic --spares 0"
    print(f"\nnp={np}, CPU float32, one host, elastic with {kind}; median of "
          f"{passes} passes of each kind (alternating), ms per call (slowest rank)")
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


def starts(np: int, count: int) -> None:
    """A plain cluster's start against an elastic one's with one hot spare, alternating."""
    took: dict = {False: [], True: []}
    own = []
    for i in range(count):
        for spare in ([True, False] if i % 2 == 0 else [False, True]):
            t0 = time.perf_counter()
            options = {} if spare else {"elastic": False}  # one host's default, or plain
            with ipydist.Session(np=np, gpus="none", **options) as s:
                took[spare].append(time.perf_counter() - t0)
                if spare:
                    own.append(psutil.Process(s.cluster.spare_pids[0]).memory_full_info().uss)
    plain, spare = statistics.median(took[False]), statistics.median(took[True])
    print(f"\n{count} starts of each (alternating), np={np}: plain (--no-elastic) {plain:.2f} s, "
          f"the default (elastic, 1 hot spare) {spare:.2f} s ({spare / plain:.2f}x); a spare holds "
          f"{statistics.median(own) / 2**20:.0f} MiB of its own (median)")


def one_heal(np: int, spares: int) -> tuple[float, float]:
    """On a fresh cluster: (kill to the end of the cell, kill to the end of the next)."""
    options = {"spares": spares} if spares else {"elastic": True, "spares": 0}
    with ipydist.Session(np=np, gpus="none", **options) as s:
        s.run(MODEL, output="rank0")
        return kill_and_heal(s, 1)


def kill_and_heal(s, victim: int) -> tuple[float, float]:
    """SIGKILL ``victim`` while the ranks run allreduces; the seconds from the kill to the end
    of that cell and to the end of the next, which checks the parameters identical."""
    killed: list[float] = []

    def kill(pid=s.ranks[victim]["pid"]):
        killed.append(time.time())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    try:
        s.run("t = torch.ones(1000)\nwhile True:\n    hvd.allreduce_(t)", output="rank0")
    except RankDied:
        pass
    ended = time.time() - killed[0]
    timer.join()
    s.run("step()\nsame = identical()", output="rank0")
    assert s.pull("same") == [True] * s.size
    return ended, time.time() - killed[0]


def heals(np: int, count: int) -> None:
    runs: dict = {0: [], 1: []}
    for i in range(count):
        for spares in ([1, 0] if i % 2 == 0 else [0, 1]):
            runs[spares].append(one_heal(np, spares))
    for spares, name in ((1, "a hot spare (the default)"), (0, "a spawn (--elastic --spares 0)")):
        ended, healed = zip(*runs[spares])
        print(f"\n{count} heals by {name}, np={np}, each on a fresh cluster: cell ended "
              f"{statistics.median(ended):.2f} s after the kill (max {max(ended):.2f}), healed "
              f"and the next cell done {statistics.median(healed):.2f} s after it (max "
              f"{max(healed):.2f}); parameters identical after each")
    ended, healed = [], []
    with ipydist.Session(np=np, gpus="none", elastic=True, spares=0) as s:
        s.run(MODEL, output="rank0")
        for i in range(count):
            e, h = kill_and_heal(s, 1 + i % (np - 1))
            ended.append(e)
            healed.append(h)
    print(f"{count} heals in a row on one cluster by spawns (rank 1..{np - 1} in turn): cell "
          f"ended {statistics.median(ended):.2f} s after the kill, next cell done "
          f"{statistics.median(healed):.2f} s after it (max {max(healed):.2f})")


def scales(np: int, count: int) -> None:
    """``Session.scale`` np -> np/2 -> np, ``count`` times, a DistributedOptimizer on board."""
    down, up = [], []
    with ipydist.Session(np=np, gpus="none", elastic=True, spares=0) as s:
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
    parser.add_argument("--spares", type=int, default=1,
                        help="the elastic cluster's hot spares in the allreduce comparison")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--heals", type=int, default=5)
    parser.add_argument("--scales", type=int, default=3)
    args = parser.parse_args(argv)
    ok = cost(args.np, args.passes, args.spares) if args.passes else True
    if args.starts:
        starts(args.np, args.starts)
    if args.heals:
        heals(args.np, args.heals)
    if args.scales:
        scales(args.np, args.scales)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
