"""Rank side: collect metric points and release them in time-throttled, numbered batches.

``log()`` may be called every step, so adding a point must cost a few microseconds; sending is
what costs, so points are released at most every ``interval`` seconds (about 10 messages a
second), and always at the end of a cell (:meth:`MetricBatcher.flush`). Each batch carries a
sequence number, so the notebook side can put batches in order and drop a repeat.
"""

from __future__ import annotations

import time

#: Key under which batches travel in an ipyparallel data_message.
DATA_KEY = "ipydist.metrics"


class MetricBatcher:
    """Buffers points; hands out ``{"seq": n, "points": [...]}`` batches when it is time."""

    def __init__(self, interval: float = 0.1, clock=time.monotonic):
        self.interval = interval
        self._clock = clock
        self._points: list[dict] = []
        self._seq = 0
        self._last_sent = clock()

    def add(self, point: dict) -> dict | None:
        """Buffer ``point``; return a batch if ``interval`` has passed since the last one."""
        self._points.append(point)
        now = self._clock()
        if now - self._last_sent >= self.interval:
            self._last_sent = now
            return self._batch()
        return None

    def flush(self) -> dict | None:
        """The points not sent yet, as a batch (None when there are none)."""
        if not self._points:
            return None
        self._last_sent = self._clock()
        return self._batch()

    def _batch(self) -> dict:
        batch = {"seq": self._seq, "points": self._points}
        self._seq += 1
        self._points = []
        return batch
