"""What the live view shows besides the curves, computed from the history: pure logic.

Rates come from rank 0's own timestamps and are counted in steps (the ``step`` of the rows), not
in rows: a cell that logs validation in a row of its own, or only every tenth step, still
reads its true steps/s. ``steps_per_s`` follows the speed of the last few seconds, pauses
included (evaluation, checkpoints). The ETA uses the average since the cell's first point
instead: right after a pause the last few seconds hold a burst of fast steps, and an ETA from
them said ``0:00`` half way through a run whose every epoch ends with that pause.

A straggler is a rank whose time outside collectives is well above the others': in synchronous
training every rank's step lasts as long as the slowest one's, and the slowest rank is the one
that waits least.
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
        out["progress"] = min(1.0, (last + 1) / history.total)
        out["eta"] = eta(history, start)
    return out


def steps_per_second(history: MetricHistory, start: int) -> float | None:
    """Steps per second over about the last RATE_WINDOW seconds of rows ``start:``, measured
    from the last row before that window (so a pause inside it counts as time without steps)."""
    end = len(history) - 1
    if end - start < 1:
        return None
    first = history.first_row_after(history.times[end] - RATE_WINDOW, start)
    return _rate(history, max(start, min(first, end) - 1), end)


def eta(history: MetricHistory, start: int) -> float | None:
    """Seconds until step ``total - 1``, at the average speed since the cell's first point
    (pauses included); None until two points at different steps and times give a speed."""
    end = len(history) - 1
    if not history.total or end - start < 1:
        return None
    rate = _rate(history, start, end)
    if not rate:
        return None
    return max(0.0, (history.total - (history.steps[end] + 1)) / rate)


def _rate(history: MetricHistory, first: int, last: int) -> float | None:
    """Steps per second from row ``first`` to row ``last``; None if the steps did not advance
    (a row logged at an earlier step) or no time passed."""
    span = history.times[last] - history.times[first]
    steps = history.steps[last] - history.steps[first]
    return _finite(steps / span) if span > 0 and steps > 0 else None


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
