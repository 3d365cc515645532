"""What the live view shows besides the curves, computed from the history: pure logic.

Rates come from rank 0's own timestamps over the last few seconds, so they follow the current
speed rather than the average since the cell began. A straggler is a rank whose time outside
collectives is well above the others': in synchronous training every rank's step lasts as long
as the slowest one's, and the slowest rank is the one that waits least.
"""

from __future__ import annotations

import math
import statistics

from ipydist.notebook.live.history import MetricHistory

#: Rates are measured over the rows of the last RATE_WINDOW seconds.
RATE_WINDOW = 5.0
#: A rank is a straggler when its compute time is this many times the median's ...
STRAGGLER_RATIO = 1.2
#: ... and at least this many seconds above it.
STRAGGLER_MIN_SECONDS = 0.002


def summarize(history: MetricHistory, start: int, world_size: int) -> dict:
    """The numbers for rows ``start:`` (one cell's), as plain JSON-able values."""
    n = len(history) - start
    out: dict = {"points": n, "latest": {}, "step": None, "total": history.total,
                 "progress": None, "eta": None, "steps_per_s": None, "samples_per_s": None,
                 "elapsed": None, "ranks": rank_strip(history, world_size)}
    if n <= 0:
        return out
    for name, row in history.last_row.items():
        if row >= start:
            out["latest"][name] = _finite(history.columns[name][row])
    last = history.steps[-1]
    out["step"] = int(last) if last.is_integer() else last
    out["elapsed"] = history.times[-1] - history.times[start]
    rate = steps_per_second(history, start)
    out["steps_per_s"] = rate
    if rate and history.batch_size:
        out["samples_per_s"] = rate * history.batch_size * world_size
    if history.total:
        done = min(1.0, (last + 1) / history.total)
        out["progress"] = done
        if rate:
            out["eta"] = max(0.0, (history.total - (last + 1)) / rate)
    return out


def steps_per_second(history: MetricHistory, start: int) -> float | None:
    """Rows per second over the last RATE_WINDOW seconds of rows ``start:``."""
    end = len(history) - 1
    if end - start < 1:
        return None
    first = history.first_row_after(history.times[end] - RATE_WINDOW, start)
    first = min(first, end - 1)
    span = history.times[end] - history.times[first]
    return _finite((end - first) / span) if span > 0 else None


def rank_strip(history: MetricHistory, world_size: int) -> list[dict]:
    """Per rank: recent step time, time outside collectives, longest step, straggler or not."""
    rows = []
    for rank in range(world_size):
        timing = history.timing.get(rank)
        recent = timing.recent() if timing else None
        step, compute, longest = recent if recent else (None, None, None)
        rows.append({"rank": rank, "step_s": step, "compute_s": compute, "max_s": longest,
                     "straggler": False})
    computes = [r["compute_s"] for r in rows if r["compute_s"] is not None]
    if len(computes) >= 2:
        median = statistics.median(computes)
        for r in rows:
            c = r["compute_s"]
            if c is not None and c > median * STRAGGLER_RATIO and c - median > (
                STRAGGLER_MIN_SECONDS
            ):
                r["straggler"] = True
    return rows


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: such values are shown as missing."""
    return x if math.isfinite(x) else None
