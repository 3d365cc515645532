"""Notebook side: metric batches put back in order, stored compactly, and kept small for display.

A long run logs millions of points, so the history is kept in columns of doubles (8 bytes a
value) rather than a dict per point, and rows are made only when asked for.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections import deque
from collections.abc import Sequence

NAN = float("nan")


class RankTiming:
    """One rank's step times: totals, and the batches of the last ``window`` seconds."""

    def __init__(self, window: float = 5.0):
        self.window = window
        self.steps = 0
        self._recent: deque[tuple[float, int, float, float, float]] = deque()

    def add(self, sent: float, steps: int, step_sum: float, step_max: float, wait_sum: float):
        self.steps += steps
        self._recent.append((sent, steps, step_sum, step_max, wait_sum))
        while self._recent and self._recent[0][0] < sent - self.window:
            self._recent.popleft()

    def forget_recent(self) -> None:
        self._recent.clear()

    def recent(self) -> tuple[float, float, float] | None:
        """(mean step seconds, mean seconds not waiting in collectives, longest step), recently."""
        steps = sum(r[1] for r in self._recent)
        if not steps:
            return None
        step_sum = sum(r[2] for r in self._recent)
        wait_sum = sum(r[4] for r in self._recent)
        return step_sum / steps, (step_sum - wait_sum) / steps, max(r[3] for r in self._recent)


class MetricHistory:
    """Every point rank 0 logged, in order, each batch counted exactly once.

    Batches from one rank are numbered 0, 1, 2, ...; a batch that arrives early waits until the
    ones before it are in, and a batch seen before is ignored. A restarted cluster's ranks count
    from 0 again (:meth:`new_cluster`), and the rows it logs are added after the earlier ones.
    Rows are ``step``, ``time``, ``cluster`` (1 for the session's first cluster, 2 after a
    restart, ...), ``cell`` (the notebook's execution count of the cell that logged it) and
    one column per metric name (NaN where a row did not log that metric).

    ``total`` and ``batch_size`` are the running cell's: a cell that did not give them shows
    no progress bar or samples/s rather than the last cell's.
    """

    def __init__(self):
        self.steps = array("d")
        self.times = array("d")
        #: Which cluster (counted from 1) and cell new points come from.
        self.cluster = 0
        self.cell = 0
        #: Where each run of rows from one cluster and cell begins, and which they are: a few
        #: numbers per cell, where two columns would cost 16 bytes a point.
        self._origin_rows: list[int] = []
        self._origins: list[tuple[int, int]] = []
        self.columns: dict[str, array] = {}
        #: Per metric, the last row that has a value (so the latest value costs no search).
        self.last_row: dict[str, int] = {}
        #: Per rank: the time between its ``log()`` calls.
        self.timing: dict[int, RankTiming] = {}
        self.total: int | None = None
        self.batch_size: int | None = None
        self._next: dict[int, int] = {}
        self._waiting: dict[int, dict[int, dict]] = {}

    def __len__(self) -> int:
        return len(self.steps)

    def new_cluster(self) -> None:
        """A (re)started cluster: its ranks number their batches from 0 again."""
        self.cluster += 1
        self._next.clear()
        self._waiting.clear()
        self.timing.clear()

    def begin_cell(self, cell: int | None = None) -> int:
        """A new cell starts (``cell``: its execution count, else the next number): step
        times, ``total`` and ``batch_size`` so far belong to earlier cells. Returns the row
        count."""
        for timing in self.timing.values():
            timing.forget_recent()
        self.cell = self.cell + 1 if cell is None else cell
        self.total = self.batch_size = None
        return len(self)

    def accept(self, rank: int, batch: dict) -> int:
        """Take one batch from ``rank``; return how many rows became available (at the end)."""
        seq = batch["seq"]
        expected = self._next.get(rank, 0)
        waiting = self._waiting.setdefault(rank, {})
        if seq < expected or seq in waiting:
            return 0
        waiting[seq] = batch
        before = len(self)
        while expected in waiting:
            self._apply(rank, waiting.pop(expected))
            expected += 1
        self._next[rank] = expected
        return len(self) - before

    def _apply(self, rank: int, batch: dict) -> None:
        self._append(batch["points"])
        steps, step_sum, step_max, wait_sum = batch["timing"]
        if steps:
            timing = self.timing.setdefault(rank, RankTiming())
            timing.add(batch["sent"], steps, step_sum, step_max, wait_sum)
        if rank == 0 or self.total is None:
            self.total = batch.get("total", self.total)
            self.batch_size = batch.get("batch_size", self.batch_size)

    def _append(self, points: dict) -> None:
        """Append a batch's columns (see ``protocol.to_columns``), NaN-padding the others."""
        before, n = len(self.steps), len(points["step"])
        if not n:
            return
        self.steps.extend(points["step"])
        self.times.extend(points["time"])
        if not self._origins or self._origins[-1] != (self.cluster, self.cell):
            self._origin_rows.append(before)
            self._origins.append((self.cluster, self.cell))
        for name, values in points["values"].items():
            if name not in self.columns:
                self.columns[name] = array("d", [NAN]) * before
            self.columns[name].extend(values)
            last = next((i for i in range(n - 1, -1, -1) if values[i] == values[i]), None)
            if last is not None:  # (NaN != NaN: a row without this metric)
                self.last_row[name] = before + last
        for column in self.columns.values():
            if len(column) == before:
                column.extend(array("d", [NAN]) * n)

    def rows(self, start: int = 0, stop: int | None = None) -> list[dict]:
        """Rows ``start:stop`` as dicts, each with only the metrics logged at that step."""
        out = []
        for i in range(start, len(self) if stop is None else stop):
            cluster, cell = self.origin(i)
            row = {"step": _number(self.steps[i]), "time": self.times[i],
                   "cluster": cluster, "cell": cell}
            for name, column in self.columns.items():
                if not math.isnan(column[i]):
                    row[name] = column[i]
            out.append(row)
        return out

    def origin(self, row: int) -> tuple[int, int]:
        """(cluster, cell) that logged row ``row``."""
        return self._origins[bisect.bisect_right(self._origin_rows, row) - 1]

    def series(self, name: str, start: int = 0, stop: int | None = None):
        """``(steps, values)`` of one metric over rows ``start:stop``, finite values only."""
        column = self.columns.get(name)
        stop = len(self) if stop is None else stop
        if column is None:
            return [], []
        xs, ys = [], []
        for i in range(start, stop):
            y = column[i]
            if math.isfinite(y):  # NaN: not logged at this step; JSON has no infinities
                xs.append(_number(self.steps[i]))
                ys.append(y)
        return xs, ys

    def first_row_after(self, t: float, start: int = 0) -> int:
        """Index of the first row (from ``start``) logged at or after time ``t``."""
        return max(start, bisect.bisect_left(self.times, t, lo=start))

    def to_dataframe(self):
        import pandas

        data = {"step": self.steps, "time": self.times, **self.columns}
        frame = pandas.DataFrame({k: pandas.Series(v, dtype="float64") for k, v in data.items()})
        if len(frame) and (frame["step"] % 1 == 0).all():
            frame["step"] = frame["step"].astype("int64")
        ends = [*self._origin_rows[1:], len(self)]
        lengths = [end - start for start, end in zip(self._origin_rows, ends)]
        for at, name, values in ((2, "cluster", [c for c, _ in self._origins]),
                                 (3, "cell", [c for _, c in self._origins])):
            frame.insert(at, name, pandas.Series(values, dtype="int64").repeat(lengths)
                         .reset_index(drop=True))
        return frame


def _number(x: float):
    """Steps are stored as doubles; give whole ones back as ints."""
    return int(x) if x.is_integer() else x


def downsample(xs: Sequence[float], ys: Sequence[float], max_points: int):
    """At most ``max_points`` points that keep the curve's shape: first, last, and each bucket's
    minimum and maximum (min/max decimation, as plotting libraries do for long series).

    Returns ``(xs, ys)`` as lists, in the original order.
    """
    n = len(xs)
    if n != len(ys):
        raise ValueError("xs and ys must have the same length")
    if n <= max_points:
        return list(xs), list(ys)
    if max_points < 4:
        raise ValueError("max_points must be at least 4")
    buckets = (max_points - 2) // 2
    size = (n - 2) / buckets
    keep = {0, n - 1}
    for b in range(buckets):
        lo = 1 + math.floor(b * size)
        hi = min(n - 1, 1 + math.floor((b + 1) * size))
        if lo >= hi:
            continue
        window = range(lo, hi)
        keep.add(min(window, key=lambda i: (ys[i], i)))
        keep.add(max(window, key=lambda i: (ys[i], -i)))
    order = sorted(keep)
    return [xs[i] for i in order], [ys[i] for i in order]
