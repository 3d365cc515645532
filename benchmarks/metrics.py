"""The cost of live metrics: ``hvd.log()`` on a rank, its latency, and what a long run keeps.

Measured in one run, each against the alternative a user has today:

1. **Cost per call** on rank 0 (median microseconds over rounds of calls), against one
   ``print()`` of the same values per step (streamed by ipyparallel), and as a share of a
   10 ms training step. Target: <= 20 us.
2. **Latency** from ``log()`` on rank 0 to the point in the notebook-side history, against the
   latency of a printed line reaching the notebook, both while a rank logs every 10 ms.
   Target: <= 250 ms.
3. **A million points**: the notebook-side memory they take (columns of doubles) against the
   same points as a list of dicts; and how much they add to the saved notebook (a notebook run
   with nbclient, logging 1,000,000 points, against the same notebook logging none; and against
   the whole series stored as JSON). Target: <= 1 MB growth.

    .venv/bin/python benchmarks/metrics.py [--np 2] [--points 1000000]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import textwrap
import time
import tracemalloc
from contextlib import redirect_stdout
from pathlib import Path

import ipydist
from ipydist.notebook.live.history import MetricHistory
from ipydist.protocol import to_columns

COST_CODE = textwrap.dedent('''
    import time, statistics
    import ipydist.torch as hvd

    def per_call(fn, calls=20000, rounds=7):
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(i)
            out.append((time.perf_counter() - t0) / calls)
        return statistics.median(out)

    def busy(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    empty = per_call(lambda i: None)
    cost_log = per_call(lambda i: hvd.log(step=i, loss=1.0 / (i + 1), acc=0.5)) - empty
    cost_print = per_call(lambda i: print(f"step {i} loss {1.0 / (i + 1):.4f} acc 0.5"),
                          calls=2000) - empty
''')

LATENCY_CODE = textwrap.dedent('''
    import time
    for i in range({n}):
        if {use_print}:
            if hvd.rank() == 0:
                print(f"T {{time.time():.6f}}")
        else:
            hvd.log(step=i, loss=float(i))
        time.sleep(0.01)
''')


def cost(session) -> dict:
    """Per-call cost of log() and of print() on rank 0 (rank 0 only: no collective)."""
    sink = _Discard()
    with redirect_stdout(sink):
        session.run(COST_CODE, ranks=[0])
    return {"log": session.pull("cost_log", rank=0), "print": session.pull("cost_print", rank=0)}


def latency(session, seconds: float) -> dict:
    """Median and 95th percentile delay, log() -> history and print() -> notebook."""
    n = int(seconds / 0.01)
    arrivals: list[float] = []
    accept = session.metrics.accept

    def timed_accept(rank, batch):
        now = time.time()
        if rank == 0:
            arrivals.extend(now - t for t in batch["points"]["time"])
        return accept(rank, batch)

    session.metrics.accept = timed_accept
    try:
        with redirect_stdout(_Discard()):
            session.run(LATENCY_CODE.format(n=n, use_print=False))
    finally:
        del session.metrics.accept
    printed = _Stamped()
    with redirect_stdout(printed):
        session.run(LATENCY_CODE.format(n=n, use_print=True))
    return {"log": _quantiles(arrivals), "print": _quantiles(printed.delays)}


def memory(points: int) -> dict:
    """Bytes held by the history for ``points`` points, against a list of dicts."""
    batch = 10_000
    gc.collect()
    tracemalloc.start()
    history = MetricHistory()
    for b in range(points // batch):
        history.accept(0, {"seq": b, "sent": 0.0, "timing": (batch, 1.0, 0.01, 0.0),
                           "points": to_columns([(s, 1e9 + s, {"loss": 1.0 / (s + 1), "acc": 0.5})
                                                 for s in range(b * batch, (b + 1) * batch)])})
    columns = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del history
    gc.collect()
    tracemalloc.start()
    rows = [{"step": s, "time": 1e9 + s, "loss": 1.0 / (s + 1), "acc": 0.5, "rank": 0}
            for s in range(points)]
    dicts = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del rows
    return {"columns": columns, "dicts": dicts}


NOTEBOOK_CELLS = [
    "%load_ext ipydist",
    "%dist_start --np {np}",
    "%%everyrank\nimport ipydist.torch as hvd\nfor i in range({points}):\n"
    "    hvd.log(step=i, total={points}, loss=1.0 / (i + 1), acc=(i % 1000) / 1000)",
    "import os, psutil\nprint('rss', psutil.Process(os.getpid()).memory_info().rss)",
    "%dist_stop",
]


def notebook_growth(np: int, points: int) -> dict:
    """Saved size of a notebook logging ``points`` points against the same logging none."""
    import nbclient
    import nbformat

    sizes, seconds, rss = {}, {}, {}
    for n in (0, points):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c.format(np=np, points=n)) for c in NOTEBOOK_CELLS]
        t0 = time.perf_counter()
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3").execute()
        seconds[n] = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "growth.ipynb"
            nbformat.write(nb, path)
            sizes[n] = path.stat().st_size
        text = "".join(o.get("text", "") for o in nb.cells[3].outputs)
        rss[n] = int(re.search(r"rss (\d+)", text).group(1))
    whole = len(json.dumps([[list(range(points)), [1.0 / (i + 1) for i in range(points)]]] * 2))
    return {"growth": sizes[points] - sizes[0], "whole_series_json": whole,
            "kernel_rss_growth": rss[points] - rss[0], "seconds": seconds[points]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    args = parser.parse_args(argv)

    with ipydist.Session(np=args.np, gpus="none") as s:
        with redirect_stdout(_Discard()):
            s.run("import ipydist.torch as hvd")
        c = cost(s)
        lat = latency(s, args.latency_seconds)
    mem = memory(args.points)
    nb = notebook_growth(args.np, args.points)

    us = 1e6
    print(f"\nnp={args.np}, CPU\n")
    print("1. cost per call on rank 0 (median of 7 rounds)")
    print(f"   hvd.log(): {c['log'] * us:6.2f} us   print(): {c['print'] * us:6.2f} us   "
          f"log/print {c['log'] / c['print']:.3f}x")
    print(f"   share of a 10 ms step: {c['log'] / 0.01:.3%}   target <= 20 us: "
          f"{'met' if c['log'] * us <= 20 else 'NOT met'}")
    print(f"2. latency, a point every 10 ms for {args.latency_seconds:g} s (median / p95 / max)")
    for name, q in lat.items():
        print(f"   {name + '()':<8} {q[0] * 1e3:6.1f} / {q[1] * 1e3:6.1f} / {q[2] * 1e3:6.1f} ms"
              f"   ({q[3]} points)")
    print(f"   log/print median {lat['log'][0] / lat['print'][0]:.2f}x   target <= 250 ms: "
          f"{'met' if lat['log'][1] <= 0.25 else 'NOT met'} (p95)")
    mib = 2**20
    print(f"3. {args.points:,} points")
    print(f"   history memory: {mem['columns'] / mib:6.1f} MiB as columns, "
          f"{mem['dicts'] / mib:6.1f} MiB as dicts   ratio {mem['columns'] / mem['dicts']:.2f}x")
    print(f"   notebook kernel RSS growth (nbclient run): {nb['kernel_rss_growth'] / mib:.1f} MiB")
    ratio = nb["growth"] / nb["whole_series_json"]
    print(f"   saved notebook growth: {nb['growth'] / 1024:.1f} KiB   whole series as JSON: "
          f"{nb['whole_series_json'] / mib:.1f} MiB   ratio {ratio:.4f}x")
    print(f"   target <= 1 MB growth: {'met' if nb['growth'] <= 1e6 else 'NOT met'}"
          f"   (the logging cell took {nb['seconds']:.1f} s with start and stop)")
    return 0


def _quantiles(values: list[float]) -> tuple[float, float, float, int]:
    if not values:
        return (float("nan"),) * 3 + (0,)
    values = sorted(values)
    return (statistics.median(values), values[int(0.95 * (len(values) - 1))], values[-1],
            len(values))


class _Discard:
    def write(self, text):
        return len(text)

    def flush(self):
        pass


class _Stamped(_Discard):
    """Collects, for each printed ``T <time>`` line, how long it took to get here."""

    def __init__(self):
        self.delays: list[float] = []

    def write(self, text):
        now = time.time()
        self.delays += [now - float(t) for t in re.findall(r"T (\d+\.\d+)", text)]
        return len(text)


if __name__ == "__main__":
    sys.exit(main())
