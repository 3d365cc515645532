"""The metrics view under one running ``%%everyrank`` cell.

:class:`LiveView` is driven from the cell's wait loop in the notebook's main thread (the same
loop that prints the ranks' output), so widget messages never come from a background thread.
It opens the widget when the cell's first point arrives, sends new points at most every
``interval`` seconds, and at the end stores the final curves in the widget and a static copy
next to it. Without a kernel (plain IPython, a script) there is no widget: a one-line summary
is printed when the cell ends.
"""

from __future__ import annotations

import math
import time
import uuid

from ipydist.notebook.display import in_kernel
from ipydist.notebook.live.history import MetricHistory, downsample
from ipydist.notebook.live.static import fallback_html, summary_line
from ipydist.notebook.live.summary import summarize

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
        self.start = self._sent = history.begin_cell(cell)
        self.widget = None
        self._static = None
        self._last_update = -math.inf

    @property
    def points(self) -> int:
        return len(self.history) - self.start

    def update(self) -> None:
        """Show what arrived since the last update, unless that was under ``interval`` ago."""
        now = time.monotonic()
        if not self.widgets or not self.points or now - self._last_update < self.interval:
            return
        self._last_update = now
        if self.widget is None:
            self._open()
        stop = len(self.history)
        if stop > self._sent:
            self.widget.append(self.points, self._series(self._sent, stop, APPEND_MAX_POINTS))
            self._sent = stop
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
        series = self._series(self.start, len(self.history), FINAL_MAX_POINTS)
        self.widget.series = {name: [xs, ys] for name, (xs, ys) in series.items()}
        self.widget.stats = stats
        self.widget.done = True
        if self._static is None:  # display() without an IPython shell returns no handle
            return
        self._static.update(
            {"text/html": fallback_html(self.widget.key, series, stats),
             "text/plain": f"[metrics] {summary_line(stats)}"},
            raw=True,
        )

    def _open(self) -> None:
        from IPython.display import display

        from ipydist.notebook.live.widget import MetricsWidget

        key = uuid.uuid4().hex[:12]
        self.widget = MetricsWidget(key=key)
        display(self.widget)
        # A placeholder right below the widget, filled with the static copy at the end.
        self._static = display(
            {"text/html": f'<div class="ipydist-fallback ipydist-fallback-{key}"></div>',
             "text/plain": ""},
            raw=True, display_id=True,
        )

    def _series(self, start: int, stop: int, max_points: int) -> dict:
        out = {}
        for name in self.history.columns:
            xs, ys = self.history.series(name, start, stop)
            if xs:
                xs, ys = downsample(xs, ys, max_points)
                out[name] = (xs, [float(f"{y:.6g}") for y in ys])  # 6 digits: plenty to draw
        return out
