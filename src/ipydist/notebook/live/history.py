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

from ipydist.specs import SpecError

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


class Columns:
    """Rows of points in columns: ``steps``, ``times`` and one column per metric (NaN where a
    row did not log it), plus which cluster and cell each run of rows came from: a few numbers
    per cell, where two more columns would cost 16 bytes a point."""

    def __init__(self):
        self.steps = array("d")
        self.times = array("d")
        self.columns: dict[str, array] = {}
        #: Per metric, the last row that has a value (so the latest value costs no search).
        self.last_row: dict[str, int] = {}
        self.origin_rows: list[int] = []
        self.origins: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, points: dict, origin: tuple[int, int]) -> None:
        """Append a batch's columns (see ``protocol.to_columns``), NaN-padding the others."""
        before, n = len(self.steps), len(points["step"])
        if not n:
            return
        self.steps.extend(points["step"])
        self.times.extend(points["time"])
        if not self.origins or self.origins[-1] != origin:
            self.origin_rows.append(before)
            self.origins.append(origin)
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

    def origin(self, row: int) -> tuple[int, int]:
        """(cluster, cell) that logged row ``row``."""
        return self.origins[bisect.bisect_right(self.origin_rows, row) - 1]

    def series(self, name: str, start: int = 0, stop: int | None = None, times: bool = False):
        """``(steps, values)`` of one metric over rows ``start:stop``, finite values only;
        with ``times``, ``(steps, values, times)``."""
        column = self.columns.get(name)
        stop = len(self) if stop is None else stop
        xs, ys, ts = [], [], []
        if column is not None:
            for i in range(start, stop):
                y = column[i]
                if math.isfinite(y):  # NaN: not logged at this step; JSON has no infinities
                    xs.append(_number(self.steps[i]))
                    ys.append(y)
                    if times:
                        ts.append(self.times[i])
        return (xs, ys, ts) if times else (xs, ys)

    def to_dataframe(self):
        import pandas

        data = {"step": self.steps, "time": self.times, **self.columns}
        frame = pandas.DataFrame({k: pandas.Series(v, dtype="float64") for k, v in data.items()})
        if len(frame) and (frame["step"] % 1 == 0).all():
            frame["step"] = frame["step"].astype("int64")
        frame["time"] = pandas.to_datetime(frame["time"], unit="s", utc=True)
        ends = [*self.origin_rows[1:], len(self)]
        lengths = [end - start for start, end in zip(self.origin_rows, ends)]
        for at, name, values in ((2, "cluster", [c for c, _ in self.origins]),
                                 (3, "cell", [c for _, c in self.origins])):
            frame.insert(at, name, pandas.Series(values, dtype="int64").repeat(lengths)
                         .reset_index(drop=True))
        return frame


class MetricHistory:
    """Every point rank 0 logged, in order, each batch counted exactly once.

    Batches from one rank are numbered 0, 1, 2, ...; a batch that arrives early waits until the
    ones before it are in, and a batch seen before is ignored. A restarted cluster's ranks count
    from 0 again (:meth:`new_cluster`), and the rows it logs are added after the earlier ones.
    Rows are ``step``, ``time``, ``cluster`` (1 for the session's first cluster, 2 after a
    restart, ...), ``cell`` (the notebook's execution count of the cell that logged it) and
    one column per metric name (NaN where a row did not log that metric).

    The other ranks send points only for ``hvd.log(reduce="none")``; theirs are kept apart,
    per rank (:attr:`by_rank`), for the per-rank curves.

    ``total`` and ``batch_size`` are the running cell's: a cell that did not give them shows
    no progress bar or samples/s rather than the last cell's.
    """

    def __init__(self):
        self.rank0 = Columns()
        #: Points of ranks other than 0 (``reduce="none"``), per rank.
        self.by_rank: dict[int, Columns] = {}
        #: Which cluster (counted from 1) and cell new points come from.
        self.cluster = 0
        self.cell = 0
        #: Per rank: the time between its ``log()`` calls.
        self.timing: dict[int, RankTiming] = {}
        self.total: int | None = None
        self.batch_size: int | None = None
        #: The reader's last widget settings (smoothing, log scale ...), for the next widget.
        self.view_settings: dict = {}
        self._next: dict[int, int] = {}
        self._waiting: dict[int, dict[int, dict]] = {}

    # rank 0's rows, as most readers want them
    steps = property(lambda self: self.rank0.steps)
    times = property(lambda self: self.rank0.times)
    columns = property(lambda self: self.rank0.columns)
    last_row = property(lambda self: self.rank0.last_row)

    def __len__(self) -> int:
        return len(self.rank0)

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

    def rank_lengths(self) -> dict[int, int]:
        """How many points each rank other than 0 has sent: where a new cell's begin."""
        return {rank: len(rows) for rank, rows in self.by_rank.items()}

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
        rows = self.rank0 if rank == 0 else self.by_rank.get(rank)
        if rows is None and len(batch["points"]["step"]):
            rows = self.by_rank[rank] = Columns()
        if rows is not None:
            rows.append(batch["points"], (self.cluster, self.cell))
        steps, step_sum, step_max, wait_sum = batch["timing"]
        if steps:
            timing = self.timing.setdefault(rank, RankTiming())
            timing.add(batch["sent"], steps, step_sum, step_max, wait_sum)
        if rank == 0 or self.total is None:
            self.total = batch.get("total", self.total)
            self.batch_size = batch.get("batch_size", self.batch_size)

    def rows(self, start: int = 0, stop: int | None = None) -> list[dict]:
        """Rows ``start:stop`` as dicts, each with only the metrics logged at that step."""
        out = []
        for i in range(start, len(self) if stop is None else stop):
            cluster, cell = self.rank0.origin(i)
            row = {"step": _number(self.steps[i]), "time": self.times[i],
                   "cluster": cluster, "cell": cell}
            for name, column in self.columns.items():
                if not math.isnan(column[i]):
                    row[name] = column[i]
            out.append(row)
        return out

    def origin(self, row: int) -> tuple[int, int]:
        """(cluster, cell) that logged row ``row``."""
        return self.rank0.origin(row)

    def series(self, name: str, start: int = 0, stop: int | None = None, times: bool = False):
        """Rank 0's values of one metric: see :meth:`Columns.series`."""
        return self.rank0.series(name, start, stop, times)

    def first_row_after(self, t: float, start: int = 0) -> int:
        """Index of the first row (from ``start``) logged at or after time ``t``."""
        return max(start, bisect.bisect_left(self.times, t, lo=start))

    def to_dataframe(self, ranks: bool = False):
        """Rank 0's rows as a DataFrame; with ``ranks``, every rank's (``reduce="none"``), a
        ``rank`` column first."""
        frame = self.rank0.to_dataframe()
        if not ranks:
            return frame
        import pandas

        frames = [frame, *(rows.to_dataframe() for _, rows in sorted(self.by_rank.items()))]
        for rank, f in zip([0, *sorted(self.by_rank)], frames):
            f.insert(0, "rank", rank)
        return pandas.concat(frames, ignore_index=True)


def _number(x: float):
    """Steps are stored as doubles; give whole ones back as ints."""
    return int(x) if x.is_integer() else x


def downsample(xs: Sequence[float], ys: Sequence[float], max_points: int):
    """At most ``max_points`` points that keep the curve's shape: first, last, and each bucket's
    minimum and maximum (min/max decimation, as plotting libraries do for long series).

    Returns ``(xs, ys)`` as lists, in the original order.
    """
    if len(xs) != len(ys):
        raise SpecError("xs and ys must have the same length")
    keep = downsample_indices(ys, max_points)
    return [xs[i] for i in keep], [ys[i] for i in keep]


def downsample_indices(ys: Sequence[float], max_points: int) -> list[int]:
    """The indices :func:`downsample` keeps, for keeping other columns (times) alongside."""
    n = len(ys)
    if n <= max_points:
        return list(range(n))
    if max_points < 4:
        raise SpecError("max_points must be at least 4")
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
    return sorted(keep)
