"""The metrics view under one running ``%%everyrank`` cell.

:class:`LiveView` is driven from the cell's wait loop in the notebook's main thread (the same
loop that prints the ranks' output), so widget messages never come from a background thread.
It opens the widget when the cell's first point arrives, sends new points at most every
``interval`` seconds, and at the end stores the final curves in the widget and a static copy
next to it. Without a kernel (plain IPython, a script) there is no widget: a one-line summary
is printed when the cell ends.

Each point travels with its step and its time (seconds since the cell's first point, for the
wall-clock axis); points the other ranks logged with ``reduce="none"`` travel per rank.
"""

from __future__ import annotations

import csv
import io
import math
import time
import uuid
from typing import TYPE_CHECKING

from ipydist.notebook.live.history import Columns, MetricHistory, downsample_indices
from ipydist.notebook.live.layout import EPOCH, chart_layout, epoch_starts
from ipydist.notebook.live.static import (
    SMOOTHING,
    fallback_bundle,
    placeholder_html,
    summary_line,
)
from ipydist.notebook.live.summary import summarize
from ipydist.notebook.output.display import in_kernel, updates_shown
from ipydist.notebook.reopen import busy_shell

if TYPE_CHECKING:
    from IPython.display import DisplayHandle

    from ipydist.notebook.live.widget import MetricsWidget

#: At most this many points per metric in one update message (min/max decimated beyond).
APPEND_MAX_POINTS = 500
#: At most this many points per metric in the saved widget state.
FINAL_MAX_POINTS = 2000


class LiveView:
    def __init__(self, history: MetricHistory, world_size: int, interval: float = 0.1,
                 widgets: bool | None = None, cell: int | None = None):
        self.history = history
        self.world_size = world_size
        self.interval = interval
        self.widgets = in_kernel() if widgets is None else widgets
        # where the front end drops a display's updates (server-side execution), the static
        # copy and the final text form are a new output at the end instead
        self._updates = not self.widgets or updates_shown()
        self.start = self._sent = history.begin_cell(cell)
        self._rank_start = history.rank_lengths()
        self._rank_sent = dict(self._rank_start)
        self.widget: MetricsWidget | None = None  # from the first update that shows points
        self._shown: DisplayHandle | None = None  # where the widget is
        self._static: DisplayHandle | None = None  # where the static copy goes
        self._last_update = -math.inf
        self._names: list[str] = []

    @property
    def points(self) -> int:
        return len(self.history) - self.start

    @property
    def t0(self) -> float:
        """When the cell's first point was logged: the wall-clock axis counts from it."""
        return self.history.times[self.start]

    def update(self) -> None:
        """Show what arrived since the last update, unless that was under ``interval`` ago."""
        now = time.monotonic()
        if not self.widgets or not self.points or now - self._last_update < self.interval:
            return
        self._last_update = now
        if self.widget is None:
            self._open()
        assert self.widget is not None  # _open made it
        self._update_charts()
        stop = len(self.history)
        ranks = self._rank_series(self._rank_sent, APPEND_MAX_POINTS)
        if stop > self._sent or ranks:
            self.widget.append(self.points, self._series(self._sent, stop, APPEND_MAX_POINTS),
                               ranks, start=self._sent - self.start)
            self._sent = stop
            self._rank_sent = self.history.rank_lengths()
        self.widget.stats = summarize(self.history, self.start, self.world_size)

    def finish(self) -> None:
        """The cell ended: final curves into the widget state, static copy beside it."""
        if not self.points:
            return
        stats = summarize(self.history, self.start, self.world_size)
        if not self.widgets:
            print(f"[metrics] {summary_line(stats)}")
            return
        if self.widget is None:
            self._open()
        assert self.widget is not None  # _open made it
        self._update_charts()
        series = self._series(self.start, len(self.history), FINAL_MAX_POINTS)
        self.widget.series = series
        self.widget.rank_series = self._rank_series(self._rank_start, FINAL_MAX_POINTS)
        self.widget.stats = stats
        self.widget.done = True
        if self._static is None or self._shown is None:  # display() without an IPython
            return  # shell returns no handle
        epochs = epoch_starts(*series[EPOCH][:2]) if EPOCH in series else []
        static = fallback_bundle(self.widget.key, {n: s[:2] for n, s in series.items()},
                                 {**stats, "epochs": epochs}, self.widget.charts,
                                 smoothing=self._smoothing(), below_widget=self._updates)
        if self._updates:
            self._shown.update(self.widget)  # its text form now says the final values
            self._static.update(static, raw=True)
        else:  # the copy, with the widget's final text form, below the cell's lines
            from IPython.display import display

            display({**static, "text/plain": repr(self.widget)}, raw=True)

    def csv(self) -> str:
        """This cell's points as CSV (every point, not the downsampled curves)."""
        out = io.StringIO()
        names = list(self.history.columns)
        writer = csv.writer(out)
        writer.writerow(["cluster", "cell", "step", "time", *names])
        for row in self.history.rows(self.start):
            writer.writerow([row["cluster"], row["cell"], row["step"], f"{row['time']:.3f}",
                             *(row.get(n, "") for n in names)])
        return out.getvalue()

    def _open(self) -> None:
        from IPython.display import display

        from ipydist.notebook.live.widget import MetricsWidget

        key = uuid.uuid4().hex[:12]
        self.widget = MetricsWidget(key=key, settings=dict(self.history.view_settings))
        busy_shell.any_thread(self.widget)  # its requests are answered while the cell runs
        self.widget.observe(self._settings_changed, "settings")
        self.widget.on_msg(self._message)
        self._shown = display(self.widget, display_id=True)
        # A placeholder right below the widget, filled with the static copy at the end.
        self._static = display(
            {"text/html": placeholder_html(key), "text/plain": ""},
            raw=True, display_id=True,
        )

    def _settings_changed(self, change) -> None:
        """The reader changed a setting: the next cell's widget starts with it."""
        self.history.view_settings = dict(change["new"])

    def _message(self, widget, content, buffers) -> None:
        """The page asks (in a subshell's thread while the cell runs, where the kernel has
        them): for the CSV, or, a page that opened while the cell ran, for every point so far
        (it then follows the appends)."""
        kind = content.get("type") if isinstance(content, dict) else None
        if kind == "csv":
            widget.send({"type": "csv", "text": self.csv()})
        elif kind == "points":
            stop = len(self.history)  # the main thread appends meanwhile: up to here
            widget.send({"type": "points", "count": stop - self.start,
                         "series": self._series(self.start, stop, FINAL_MAX_POINTS),
                         "rank_series": self._rank_series(self._rank_start, FINAL_MAX_POINTS)})

    def _smoothing(self) -> float:
        """The reader's smoothing (the widget's default where none was chosen)."""
        assert self.widget is not None  # asked once it is shown
        value = self.widget.settings.get("smoothing", SMOOTHING)
        return value if isinstance(value, (int, float)) and 0 <= value < 1 else SMOOTHING

    def _update_charts(self) -> None:
        names = [n for n in self.history.columns if self.history.last_row.get(n, -1)
                 >= self.start]
        for rows in self.history.by_rank.values():
            names += [n for n in rows.columns if n not in names]
        if names != self._names:
            self._names = names
            assert self.widget is not None  # called once it is shown
            self.widget.charts = chart_layout(names, self.widget.charts)

    def _series(self, start: int, stop: int, max_points: int) -> dict:
        return _columns_series(self.history.rank0, self._names, start, stop, max_points,
                               self.t0)

    def _rank_series(self, starts: dict[int, int], max_points: int) -> dict:
        """``{name: {rank: [steps, values, times]}}`` of the other ranks' new points."""
        out: dict = {}
        for rank, rows in self.history.by_rank.items():
            begin = starts.get(rank, 0)
            if len(rows) <= begin:
                continue
            for name, s in _columns_series(rows, list(rows.columns), begin, len(rows),
                                           max_points, self.t0).items():
                out.setdefault(name, {})[str(rank)] = s
        return out


def _columns_series(rows: Columns, names: list[str], start: int, stop: int, max_points: int,
                    t0: float) -> dict:
    out = {}
    for name in names:
        xs, ys, ts = rows.series(name, start, stop, times=True)
        if xs:
            keep = downsample_indices(ys, max_points)
            out[name] = [[xs[i] for i in keep],
                         [float(f"{ys[i]:.6g}") for i in keep],  # 6 digits: plenty to draw
                         [round(ts[i] - t0, 3) for i in keep]]
    return out
