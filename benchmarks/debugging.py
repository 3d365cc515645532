"""What debugging a rank costs, against a plain ipyparallel round trip in the same run.

1. Idle ranks: ``Session.stacks()`` (every rank's stack, asked on the engines' control
   channel) against an ipyparallel ``apply`` of a no-op to every rank (what ``%dist_pull``
   costs; the no-op is ``int``, a builtin, so nothing of this script travels), interleaved;
   and one post-mortem pdb command (``p secret`` on the rank that failed, what
   ``%dist_debug`` sends per line) against an ``apply`` to that rank.
2. Busy ranks, in a training loop: ``Session.stacks()`` while the cell runs (no ``apply``
   reaches a busy engine: its requests queue behind the cell); and the loop's step time with
   the stacks asked four times a second against without, alternating cells.

Printed: medians in ms and the ratios.

    .venv/bin/python benchmarks/debugging.py [--np 4] [--rounds 20] [--steps 600]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import ipydist
from ipydist.errors import RankError

FAILS = """
def failing(r):
    secret = 1000 + r
    if r == 1:
        raise ValueError("for the post-mortem")
failing(hvd.rank())
"""
TRAIN = """
import time, torch, ipydist.torch as hvd
torch.manual_seed(hvd.rank())
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
def train(steps):
    t0 = time.perf_counter()
    for _ in range(steps):  # the same number on every rank: each step is a collective
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()
    return (time.perf_counter() - t0) / steps
"""


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=600, help="steps of a training cell")
    args = parser.parse_args()
    with ipydist.Session(np=args.np, gpus="none") as s:
        cluster, every = s.cluster, list(range(args.np))
        s.run("import ipydist.torch as hvd", output="rank0")
        idle = {"stacks": [], "apply": [], "pdb": [], "apply1": []}
        for r in range(args.rounds):
            pair = [("stacks", s.stacks), ("apply", lambda: cluster.view(every).apply_sync(int))]
            for name, fn in pair[r % 2:] + pair[:r % 2]:
                idle[name].append(timed(fn))
        try:
            s.run(FAILS, output="rank0")
        except RankError:
            pass
        cluster.call("debug", None, timeout=30, ranks=[1])
        for r in range(args.rounds):
            pair = [("pdb", lambda: cluster.call("debug", "p secret", timeout=30, ranks=[1])),
                    ("apply1", lambda: cluster.view([1]).apply_sync(int))]
            for name, fn in pair[r % 2:] + pair[:r % 2]:
                idle[name].append(timed(fn))
        cluster.call("debug", "q", timeout=30, ranks=[1])

        s.run(TRAIN, output="rank0")
        busy, steps = [], {"polled": [], "alone": []}
        for r in range(4):
            for polled in ([True, False] if r % 2 == 0 else [False, True]):
                done = threading.Event()

                def poll(done=done):
                    while not done.wait(0.25):
                        busy.append(timed(s.stacks))

                poller = threading.Thread(target=poll) if polled else None
                if poller:
                    poller.start()
                try:
                    s.run(f"step = train({args.steps})", output="rank0")
                finally:
                    done.set()
                    if poller:
                        poller.join()
                steps["polled" if polled else "alone"].append(max(s.pull("step")))

    med = {k: statistics.median(v) for k, v in idle.items()}
    print(f"\nnp={args.np}, CPU, medians of {args.rounds} interleaved rounds (ms)")
    print(f"  idle ranks: Session.stacks() {med['stacks']:.2f}, apply to every rank "
          f"{med['apply']:.2f}: stacks/apply {med['stacks'] / med['apply']:.2f}x")
    print(f"  post-mortem: one pdb command {med['pdb']:.2f}, apply to that rank "
          f"{med['apply1']:.2f}: pdb/apply {med['pdb'] / med['apply1']:.2f}x")
    print(f"  busy ranks (training): Session.stacks() median {statistics.median(busy):.2f}, "
          f"p95 {sorted(busy)[int(0.95 * (len(busy) - 1))]:.2f} ({len(busy)} asked)")
    polled, alone = statistics.median(steps["polled"]), statistics.median(steps["alone"])
    print(f"  step time with stacks asked 4 times a second {polled * 1e3:.3f} ms, without "
          f"{alone * 1e3:.3f} ms: {polled / alone:.3f}x")


if __name__ == "__main__":
    main()
