"""Notebook side: metric batches put back in order, and series kept small for display."""

from __future__ import annotations

import math
from collections.abc import Sequence


class MetricHistory:
    """Every point the ranks logged, in order, each batch counted exactly once.

    Batches from one rank are numbered 0, 1, 2, ...; a batch that arrives early waits until the
    ones before it are in, and a batch seen before is ignored.
    """

    def __init__(self):
        self.points: list[dict] = []
        self._next: dict[int, int] = {}
        self._waiting: dict[int, dict[int, list[dict]]] = {}

    def accept(self, rank: int, batch: dict) -> list[dict]:
        """Take one batch from ``rank``; return the points that became available, in order."""
        seq = batch["seq"]
        expected = self._next.get(rank, 0)
        waiting = self._waiting.setdefault(rank, {})
        if seq < expected or seq in waiting:
            return []
        waiting[seq] = [dict(p, rank=rank) for p in batch["points"]]
        released: list[dict] = []
        while expected in waiting:
            released += waiting.pop(expected)
            expected += 1
        self._next[rank] = expected
        self.points += released
        return released

    @property
    def missing(self) -> dict[int, list[int]]:
        """Per rank, the batch numbers skipped so far (batches after them already arrived)."""
        return {
            rank: sorted(set(range(self._next.get(rank, 0), max(w))) - set(w))
            for rank, w in self._waiting.items() if w
        }


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
