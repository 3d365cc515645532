"""The notebook-side live view on its own: what it sends to the widget, what it keeps, and how
small a long run stays. (The widget's comm has no front end here; the browser test and the
executed notebooks cover the front end.)"""

from __future__ import annotations

import json

from ipydist.notebook.live.history import MetricHistory
from ipydist.notebook.live.view import APPEND_MAX_POINTS, FINAL_MAX_POINTS, LiveView
from ipydist.protocol import to_columns


def feed(history, first_seq, steps, per_batch=1000):
    for b in range(steps // per_batch):
        start = (first_seq + b) * per_batch
        history.accept(0, {
            "seq": first_seq + b, "sent": float(b), "timing": (per_batch, 1.0, 0.002, 0.2),
            "total": 200_000, "batch_size": 16,
            "points": to_columns([(s, s * 1e-3, {"loss": 1.0 / (s + 1)})
                                  for s in range(start, start + 1000)]),
        })


def test_view_sends_only_new_points_and_saves_a_small_final_state(shell):
    history = MetricHistory()
    feed(history, 0, 5000)  # an earlier cell's points: not this cell's chart
    view = LiveView(history, world_size=2, interval=0.0, widgets=True)
    view.update()
    assert view.widget is None, "no widget before the cell's first point"
    sent = []
    for b in range(200):
        feed(history, 5 + b, 1000)
        view.update()
        if b == 0:
            view.widget.send = lambda content, buffers=None: sent.append(content)
    assert len(sent) == 199
    assert all(m["type"] == "append" for m in sent)
    assert all(len(m["series"]["loss"][0]) <= APPEND_MAX_POINTS for m in sent)
    firsts = [m["series"]["loss"][0][0] for m in sent]
    assert firsts == [5000 + 1000 * b for b in range(1, 200)], "each point range sent once"
    assert sent[-1]["count"] == 200_000
    view.finish()
    widget = view.widget
    steps, losses, seconds = widget.series["loss"]
    assert len(steps) <= FINAL_MAX_POINTS and steps[0] == 5000 and steps[-1] == 204_999
    assert len(seconds) == len(steps) and seconds[0] == 0.0 and seconds[-1] == 199.999
    assert [c["title"] for c in widget.charts["charts"]] == ["loss"]
    assert widget.done and widget.stats["points"] == 200_000 and widget.stats["progress"] == 1.0
    state = json.dumps({"series": widget.series, "stats": widget.stats})
    assert len(state) < 100_000, "200,000 points keep the saved state small"


def test_without_a_kernel_the_cell_ends_with_a_summary_line(shell, capsys):
    history = MetricHistory()
    view = LiveView(history, world_size=1, interval=0.0)
    assert not view.widgets
    feed(history, 0, 1000)
    view.update()
    view.finish()
    assert view.widget is None
    assert capsys.readouterr().out.startswith("[metrics] last: loss 0.001 · ")


def test_csv_export_asks_the_kernel_for_every_point_of_the_cell(shell):
    history = MetricHistory()
    feed(history, 0, 1000)  # an earlier cell's
    view = LiveView(history, world_size=1, interval=0.0, widgets=True, cell=5)
    feed(history, 1, 5000)
    view.update()
    sent = []
    view.widget.send = lambda content, buffers=None: sent.append(content)
    view._message(view.widget, {"type": "csv"}, [])
    lines = sent[0]["text"].splitlines()
    assert sent[0]["type"] == "csv" and lines[0] == "cluster,cell,step,time,loss"
    assert len(lines) == 1 + 5000, "every point of this cell, not the downsampled curve"
    assert lines[1].startswith("0,5,1000,1.000,")


def test_settings_the_reader_chose_carry_over_to_the_next_cells_widget(shell):
    history = MetricHistory()
    view = LiveView(history, world_size=1, interval=0.0, widgets=True)
    feed(history, 0, 1000)
    view.update()
    view.widget.settings = {"smoothing": 0.9, "log": {"loss": True}}  # as the front end sets
    later = LiveView(history, world_size=1, interval=0.0, widgets=True)
    feed(history, 1, 1000)
    later.update()
    assert later.widget.settings == {"smoothing": 0.9, "log": {"loss": True}}


def test_the_chart_plan_is_not_ipywidgets_layout(shell):
    """``layout`` is every ipywidget's reference to a Layout model, for which the front end
    builds a child view: a dict there made JupyterLab throw each time a chart appeared."""
    import ipywidgets

    from ipydist.notebook.live.widget import MetricsWidget

    history = MetricHistory()
    view = LiveView(history, world_size=1, interval=0.0, widgets=True)
    feed(history, 0, 1000)
    view.update()
    view.finish()
    widget = view.widget
    assert isinstance(widget.layout, ipywidgets.Layout)
    state = widget.get_state()
    assert state["layout"] == f"IPY_MODEL_{widget.layout.model_id}"
    assert [c["title"] for c in state["charts"]["charts"]] == ["loss"]
    assert "charts" not in ipywidgets.DOMWidget.class_trait_names(), "no other clash"
    assert set(MetricsWidget.class_trait_names(sync=True)) >= {"charts", "series", "stats"}


def test_the_static_copy_is_drawn_with_the_readers_smoothing(shell):
    history = MetricHistory()
    view = LiveView(history, world_size=1, interval=0.0, widgets=True)
    feed(history, 0, 1000)
    view.update()
    view.widget.settings = {"smoothing": 0.0}
    sent = []
    view._static = type("Handle", (), {"update": lambda self, b, raw: sent.append(b)})()
    view.finish()
    assert "smoothed" not in sent[0]["text/html"], "the reader turned smoothing off"
    assert "loss: last 0.001" in sent[0]["text/html"]
