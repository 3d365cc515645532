"""Collect metric points and step timings, release them in throttled numbered batches.

``log()`` may be called every step, so adding a point must cost a few microseconds; sending is
what costs, so points are released at most every ``interval`` seconds (about 10 messages a
second), and always at the end of a cell (:meth:`MetricBatcher.flush`). Each batch carries a
sequence number, so the notebook side can put batches in order and drop a repeat.

Only rank 0's points travel (they are what the chart shows), and the other ranks' when they
log with ``reduce="none"`` (for per-rank curves). Every rank's step timing travels
as a sum per batch, not per step, so N ranks logging a million steps send a few numbers each.
"""

from __future__ import annotations

import time

from ipydist.protocol import to_columns


class MetricBatcher:
    """Buffers points and timings; hands out batches when ``interval`` has passed.

    Batches are in the format :mod:`ipydist.protocol` describes.
    """

    def __init__(self, interval: float = 0.1, clock=time.monotonic):
        self.interval = interval
        #: The latest ``total`` and ``batch_size`` given to ``log()``; sent with every batch.
        self.total: int | None = None
        self.batch_size: int | None = None
        self._clock = clock
        self._seq = 0
        self._last_sent = clock()
        self._reset()

    def _reset(self) -> None:
        self._points: list[tuple] = []
        self._steps = 0
        self._step_sum = self._step_max = self._wait_sum = 0.0

    def add(self, point: tuple | None, step_seconds: float | None = None,
            wait_seconds: float = 0.0) -> dict | None:
        """Buffer ``point`` (None when it is not sent) and the time since the previous call.

        Returns a batch if ``interval`` has passed since the last one.
        """
        if point is not None:
            self._points.append(point)
        if step_seconds is not None:
            self._steps += 1
            self._step_sum += step_seconds
            self._wait_sum += wait_seconds
            if step_seconds > self._step_max:
                self._step_max = step_seconds
        now = self._clock()
        if now - self._last_sent >= self.interval:
            self._last_sent = now
            return self._batch()
        return None

    def flush(self) -> dict | None:
        """What was not sent yet, as a batch (None when there is nothing)."""
        self._last_sent = self._clock()
        return self._batch()

    def _batch(self) -> dict | None:
        if not self._points and not self._steps:
            return None
        batch = {
            "seq": self._seq,
            "points": to_columns(self._points),
            "timing": (self._steps, self._step_sum, self._step_max, self._wait_sum),
            "total": self.total,
            "batch_size": self.batch_size,
            "sent": time.time(),
        }
        self._seq += 1
        self._reset()
        return batch
