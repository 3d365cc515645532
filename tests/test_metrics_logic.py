"""Pure logic of metrics: throttled numbered batches, in-order history, downsampling."""

import math
import random

import pytest

from ipydist.live import MetricBatcher, MetricHistory, downsample


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_batches_are_throttled_and_numbered():
    clock = Clock()
    b = MetricBatcher(interval=0.1, clock=clock)
    sent = []
    for step in range(100):  # 100 points over 0.5 s
        clock.now = step * 0.005
        batch = b.add({"step": step})
        if batch:
            sent.append(batch)
    sent.append(b.flush())
    assert b.flush() is None
    assert len(sent) <= 6, "about ten batches a second at most"
    assert [s["seq"] for s in sent] == list(range(len(sent)))
    assert [p["step"] for s in sent for p in s["points"]] == list(range(100))


def test_history_orders_batches_and_counts_each_once():
    history = MetricHistory()
    batches = [{"seq": i, "points": [{"step": 2 * i}, {"step": 2 * i + 1}]} for i in range(50)]
    shuffled = batches + random.Random(0).sample(batches, 20)  # with repeats
    random.Random(1).shuffle(shuffled)
    for batch in shuffled:
        history.accept(0, batch)
    assert [p["step"] for p in history.points] == list(range(100))
    assert {p["rank"] for p in history.points} == {0}
    assert history.missing == {}


def test_history_reports_a_gap_and_holds_later_batches():
    history = MetricHistory()
    assert history.accept(3, {"seq": 0, "points": [{"x": 0}]}) == [{"x": 0, "rank": 3}]
    assert history.accept(3, {"seq": 2, "points": [{"x": 2}]}) == []
    assert history.missing == {3: [1]}
    released = history.accept(3, {"seq": 1, "points": [{"x": 1}]})
    assert [p["x"] for p in released] == [1, 2]


def test_downsample_keeps_ends_and_extremes_within_budget():
    n = 1_000_000
    xs = list(range(n))
    ys = [math.sin(i / 5000) + (5.0 if i == 123_457 else 0.0) for i in xs]
    dx, dy = downsample(xs, ys, 2000)
    assert len(dx) <= 2000
    assert dx[0] == 0 and dx[-1] == n - 1 and dx == sorted(dx)
    assert max(dy) == max(ys) and min(dy) == min(ys)
    assert 123_457 in dx, "a spike survives decimation"


def test_downsample_leaves_short_series_alone_and_rejects_bad_input():
    assert downsample([1, 2], [3, 4], 10) == ([1, 2], [3, 4])
    with pytest.raises(ValueError):
        downsample([1, 2], [3], 10)
    with pytest.raises(ValueError):
        downsample(list(range(10)), list(range(10)), 3)
