"""Pure logic of metrics: throttled numbered batches, in-order history, rates, stragglers,
downsampling. (The charts' layout, numbers and static copy: test_live_layout.py.)"""

import math
import random

import pytest

from ipydist.notebook.live.history import MetricHistory, downsample
from ipydist.notebook.live.summary import rank_strip, summarize
from ipydist.protocol import to_columns
from ipydist.torch.training.batching import MetricBatcher

NO_POINTS = to_columns([])  # a batch from a rank other than 0: step times only


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def batch(seq, steps, rank_timing=(0, 0.0, 0.0, 0.0), sent=0.0, **extra):
    return {"seq": seq, "points": to_columns([(s, float(s), {"loss": 1.0 / (s + 1)})
                                              for s in steps]),
            "timing": rank_timing, "sent": sent, **extra}


def test_batches_are_throttled_and_numbered():
    clock = Clock()
    b = MetricBatcher(interval=0.1, clock=clock)
    sent = []
    for step in range(100):  # 100 points over 0.5 s
        clock.now = step * 0.005
        out = b.add((step, clock.now, {"loss": 1.0}), step_seconds=0.005, wait_seconds=0.001)
        if out:
            sent.append(out)
    sent.append(b.flush())
    assert b.flush() is None, "nothing left: no empty batch"
    assert len(sent) <= 6, "about ten batches a second at most"
    assert [s["seq"] for s in sent] == list(range(len(sent)))
    assert [x for s in sent for x in s["points"]["step"]] == list(range(100))
    assert sum(s["timing"][0] for s in sent) == 100
    assert math.isclose(sum(s["timing"][3] for s in sent), 0.1)


def test_other_ranks_send_timing_only_and_nothing_when_idle():
    clock = Clock()
    b = MetricBatcher(interval=0.1, clock=clock)
    assert b.add(None, step_seconds=None) is None  # first call of a cell: no step time yet
    clock.now = 1.0
    assert b.add(None, step_seconds=None) is None, "nothing to send: no batch, no number used"
    out = b.add(None, step_seconds=0.02)
    assert out is None  # throttled: the previous call set the clock
    clock.now = 2.0
    out = b.add(None, step_seconds=0.03)
    assert out["seq"] == 0 and len(out["points"]["step"]) == 0
    assert out["timing"][:3] == (2, 0.05, 0.03)


def test_history_orders_batches_and_counts_each_once():
    history = MetricHistory()
    batches = [batch(i, [2 * i, 2 * i + 1]) for i in range(50)]
    shuffled = batches + random.Random(0).sample(batches, 20)  # with repeats
    random.Random(1).shuffle(shuffled)
    for b in shuffled:
        history.accept(0, b)
    assert list(history.steps) == list(range(100))
    assert [r["step"] for r in history.rows()] == list(range(100))


def test_history_reports_a_gap_and_holds_later_batches():
    history = MetricHistory()
    assert history.accept(0, batch(0, [0])) == 1
    assert history.accept(0, batch(2, [2])) == 0
    assert list(history.steps) == [0], "batch 2 waits for batch 1"
    assert history.accept(0, batch(1, [1])) == 2
    assert list(history.steps) == [0, 1, 2]


def test_history_keeps_metrics_logged_at_some_steps_only():
    history = MetricHistory()
    history.accept(0, {"seq": 0, "sent": 0.0, "timing": (0, 0, 0, 0), "points": to_columns([
        (0, 0.0, {"loss": 2.0}), (1, 1.0, {"loss": 1.0, "val_acc": 0.5}), (2, 2.0, {"loss": 0.5}),
    ])})
    history.accept(0, {"seq": 1, "sent": 0.0, "timing": (0, 0, 0, 0),
                       "points": to_columns([(3, 3.0, {"loss": float("inf")})])})
    assert history.rows()[1] == {"step": 1, "time": 1.0, "cluster": 0, "cell": 0, "loss": 1.0,
                                 "val_acc": 0.5}
    assert "val_acc" not in history.rows()[0]
    assert history.series("val_acc") == ([1], [0.5])
    assert history.series("loss") == ([0, 1, 2], [2.0, 1.0, 0.5]), "no infinity for JSON"
    pandas = pytest.importorskip("pandas")
    frame = history.to_dataframe()
    assert list(frame.columns) == ["step", "time", "cluster", "cell", "loss", "val_acc"]
    assert frame["step"].dtype == "int64" and math.isnan(frame["val_acc"][0])
    assert isinstance(frame["time"].dtype, pandas.DatetimeTZDtype)
    assert frame["time"][1].timestamp() == 1.0


def test_summary_rates_progress_and_eta():
    history = MetricHistory()
    # 100 steps, 10 a second, of a 200-step run, 32 samples per rank per step, 4 ranks
    for i in range(10):
        history.accept(0, {"seq": i, "sent": i, "total": 200, "batch_size": 32,
                           "timing": (10, 1.0, 0.15, 0.4),
                           "points": to_columns([(s, s / 10, {"loss": 1.0})
                                                 for s in range(10 * i, 10 * i + 10)])})
    stats = summarize(history, 0, world_size=4)
    assert stats["points"] == 100 and stats["step"] == 99 and stats["latest"] == {"loss": 1.0}
    assert stats["steps_per_s"] == pytest.approx(10.0)
    assert stats["samples_per_s"] == pytest.approx(10 * 32 * 4)
    assert stats["progress"] == pytest.approx(0.5) and stats["eta"] == pytest.approx(10.0)
    assert stats["elapsed"] == pytest.approx(9.9)
    empty = summarize(history, len(history), world_size=4)
    assert empty["points"] == 0 and empty["steps_per_s"] is None and empty["latest"] == {}


def _quickstart(history, until_step, pause=8.0, step_s=0.005):
    """As notebooks/01-quickstart.ipynb logs: 10 steps an epoch of a 200-step run, then an
    evaluation (``pause`` seconds) and its ``val_acc`` in a row of its own at the epoch's last
    step. Rows up to step ``until_step``."""
    t, rows = 0.0, []
    for e in range(20):
        for i in range(10):
            t += step_s
            if e * 10 + i > until_step:
                break
            rows.append((e * 10 + i, t, {"epoch": e, "loss": 1.0}))
        else:
            t += pause
            rows.append(((e + 1) * 10 - 1, t, {"val_acc": 0.9}))
            continue
        break
    history.accept(0, {"seq": 0, "sent": t, "total": 200, "batch_size": 32,
                       "timing": (len(rows), 0.0, 0.0, 0.0), "points": to_columns(rows)})


def test_eta_counts_the_pauses_between_epochs():
    # Step 111 of 200 (56 %), just after epoch 10's evaluation: the last few seconds hold only
    # two fast steps; an ETA from them was 0:00. Every epoch still has its 8 s pause ahead.
    history = MetricHistory()
    _quickstart(history, until_step=111)
    stats = summarize(history, 0, world_size=4)
    assert stats["progress"] == pytest.approx(0.56)
    seconds_per_step = (8.0 + 10 * 0.005) / 10
    assert stats["eta"] == pytest.approx(88 * seconds_per_step, rel=0.1)
    assert stats["steps_per_s"] < 1, "the speed of the last 5 s counts the pause in them"


def test_rates_count_steps_not_rows():
    history = MetricHistory()  # every tenth step logged, one a second: 10 steps/s
    history.accept(0, {"seq": 0, "sent": 0.0, "total": 1000, "timing": (0, 0.0, 0.0, 0.0),
                       "points": to_columns([(s, s / 10, {"loss": 1.0})
                                             for s in range(0, 200, 10)])})
    stats = summarize(history, 0, world_size=1)
    assert stats["steps_per_s"] == pytest.approx(10.0)
    assert stats["eta"] == pytest.approx((1000 - 191) / 10)


def test_no_eta_until_there_is_a_speed():
    history = MetricHistory()
    history.accept(0, batch(0, [0], total=100))
    assert summarize(history, 0, world_size=1)["eta"] is None, "one point: no speed yet"
    history.accept(0, {"seq": 1, "sent": 0.0, "total": 100, "timing": (0, 0.0, 0.0, 0.0),
                       "points": to_columns([(0, 0.0, {"loss": 1.0})])})
    stats = summarize(history, 0, world_size=1)
    assert stats["eta"] is None and stats["steps_per_s"] is None, "no step advanced"


def test_straggler_is_the_rank_that_waits_least():
    history = MetricHistory()
    for rank in range(4):
        # every step lasts 50 ms everywhere (synchronous training); rank 2 waits only 5 ms of it
        wait = 0.005 if rank == 2 else 0.030
        history.accept(rank, {"seq": 0, "sent": 0.0, "points": NO_POINTS,
                              "timing": (10, 0.5, 0.06, 10 * wait)})
    strip = rank_strip(history, 4)
    assert [r["straggler"] for r in strip] == [False, False, True, False]
    assert strip[2]["compute_s"] == pytest.approx(0.045)
    assert strip[0]["step_s"] == pytest.approx(0.05)
    even = MetricHistory()
    for rank in range(4):
        even.accept(rank, {"seq": 0, "sent": 0.0, "points": NO_POINTS,
                           "timing": (10, 0.5, 0.06, 0.3)})
    assert not any(r["straggler"] for r in rank_strip(even, 4))
    assert rank_strip(MetricHistory(), 2)[1]["step_s"] is None, "a rank that never logged"


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


def test_a_new_cell_shows_only_its_own_step_times():
    history = MetricHistory()
    history.accept(1, {"seq": 0, "sent": 0.0, "points": NO_POINTS,
                       "timing": (1000, 1.0, 0.01, 0.0)})
    assert history.begin_cell() == 0
    assert rank_strip(history, 2)[1]["step_s"] is None
    history.accept(1, {"seq": 1, "sent": 1.0, "points": NO_POINTS, "timing": (10, 0.5, 0.06, 0.1)})
    assert rank_strip(history, 2)[1]["step_s"] == pytest.approx(0.05)
    assert history.timing[1].steps == 1010


def test_points_survive_any_number_of_restarts_and_say_where_they_came_from():
    history = MetricHistory()
    for cluster in (1, 2, 3):
        history.new_cluster()  # the new ranks number their batches from 0 again
        history.begin_cell(cell=10 * cluster)
        for seq in range(4):
            history.accept(0, batch(seq, range(seq * 10, seq * 10 + 10)))
    assert len(history) == 120, "no batch of a restarted cluster may be dropped"
    rows = history.rows()
    assert [r["cluster"] for r in rows] == [1] * 40 + [2] * 40 + [3] * 40
    assert {r["cell"] for r in rows} == {10, 20, 30}
    pytest.importorskip("pandas")
    frame = history.to_dataframe()
    assert list(frame.columns[:5]) == ["step", "time", "cluster", "cell", "loss"]
    assert frame.groupby("cluster").size().tolist() == [40, 40, 40]


def test_total_and_batch_size_belong_to_the_cell_that_gave_them():
    history = MetricHistory()
    history.new_cluster()
    history.begin_cell(cell=1)
    history.accept(0, batch(0, range(30), total=30, batch_size=64))
    assert (history.total, history.batch_size) == (30, 64)
    start = history.begin_cell(cell=2)
    history.accept(0, batch(1, range(30, 81), rank_timing=(51, 0.5, 0.02, 0.0)))
    stats = summarize(history, start, world_size=2)
    assert history.total is None and history.batch_size is None
    assert stats["points"] == 51 and stats["steps_per_s"], stats
    assert stats["total"] is None and stats["progress"] is None and stats["eta"] is None
    assert stats["samples_per_s"] is None, "no batch_size in this cell: no samples/s"
    assert history.cell == 2 and history.begin_cell() == 81 and history.cell == 3


def test_a_rank_forgets_total_and_batch_size_when_its_cell_ends():
    b = MetricBatcher(interval=0.0)
    b.total, b.batch_size = 30, 64
    from ipydist.torch.training import metrics

    saved, metrics._batcher = metrics._batcher, b
    try:
        metrics.flush()
    finally:
        metrics._batcher = saved
    assert b.total is None and b.batch_size is None


def test_other_ranks_points_are_kept_per_rank_apart_from_rank0s_rows():
    """``hvd.log(reduce="none")``: every rank's values travel; rank 0's are the rows."""
    history = MetricHistory()
    history.new_cluster()
    history.begin_cell(cell=7)
    history.accept(0, batch(0, range(5)))
    history.accept(1, batch(0, range(5)))
    history.accept(2, {"seq": 0, "sent": 0.0, "points": NO_POINTS, "timing": (1, 0.1, 0.1, 0)})
    assert len(history) == 5, "rank 1's points are not rows of the chart"
    assert set(history.by_rank) == {1}, "a rank that sent no point has no store"
    assert history.by_rank[1].series("loss")[0] == [0, 1, 2, 3, 4]
    assert history.rank_lengths() == {1: 5}
    pandas = pytest.importorskip("pandas")
    frame = history.to_dataframe(ranks=True)
    assert list(frame.columns[:5]) == ["rank", "step", "time", "cluster", "cell"]
    assert frame.groupby("rank").size().to_dict() == {0: 5, 1: 5}
    assert (frame["cell"] == 7).all() and isinstance(frame["time"][0], pandas.Timestamp)


def test_a_framework_s_metric_named_like_an_option_of_log_is_a_metric(monkeypatch):
    """Lightning and the HF Trainer hand their metrics as a mapping (``log_values``): one
    they name ``reduce``, ``total`` or ``batch_size`` is drawn, not taken for (or clashing
    with) the option of that name."""
    from ipydist.torch.training import metrics

    sent = []
    monkeypatch.setattr(metrics, "_batcher", MetricBatcher(interval=0.0))
    monkeypatch.setattr(metrics, "_is_rank0", True)
    monkeypatch.setattr(metrics, "_send", lambda key, batch: sent.append(batch))
    named = {"reduce": 0.5, "total": 2.0, "batch_size": 8.0, "loss": 1.0}
    metrics.log_values(named, step=7, total=10)
    history = MetricHistory()
    for b in sent:
        history.accept(0, b)
    (row,) = history.rows()
    assert row["step"] == 7 and {k: row[k] for k in named} == named
