"""Pure logic of how metrics are drawn: the number formatter (its table of cases is shared with
the widget's JavaScript, which test_browser.py runs on the same table), which series share a
chart, and the static copy a saved notebook keeps."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ipydist.notebook.live import layout, numbers
from ipydist.notebook.live.static import (
    HEIGHT,
    chart_svg,
    fallback_bundle,
    legend_text,
    nice_ticks,
    summary_line,
    x_ticks,
)

CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "numbers.json").read_text())


def _value(v):
    return float(v) if isinstance(v, str) else v  # "nan", "inf": JSON has no such numbers


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['fn']}({c['in']})")
def test_numbers_read_as_a_person_writes_them(case):
    fn = getattr(numbers, case["fn"])
    assert fn(_value(case["in"])) == case["out"], case.get("why", "")


def test_the_table_covers_what_the_issue_saw():
    outs = {c["out"] if isinstance(c["out"], str) else tuple(c["out"]) for c in CASES}
    for wanted in ("200,000", "1.5", "0.01", "190 k", "24.3 M", "1e-4", "–"):
        assert wanted in outs
    assert ("0", "50 k", "100 k", "150 k") in outs


def test_train_and_validation_of_one_quantity_share_a_chart():
    got = layout.chart_layout(["loss", "lr", "val_loss", "acc", "val_acc", "epoch", "test_acc"])
    assert [c["title"] for c in got["charts"]] == ["loss", "lr", "acc"]
    assert [[s["name"] for s in c["series"]] for c in got["charts"]] == [
        ["loss", "val_loss"], ["lr"], ["acc", "val_acc", "test_acc"]]
    colors = [s["color"] for c in got["charts"] for s in c["series"]]
    assert len(set(colors)) == len(colors), "every series its own colour"
    assert got["epoch"] is True, "epoch is drawn as lines, not as a chart"
    assert {s["name"]: s["best"] for c in got["charts"] for s in c["series"]} == {
        "loss": "min", "val_loss": "min", "lr": None, "acc": "max", "val_acc": "max",
        "test_acc": "max"}


def test_names_split_by_prefix_or_suffix_and_other_separators():
    assert layout.quantity("val/loss") == "loss"
    assert layout.quantity("loss_val") == "loss"
    assert layout.quantity("train-accuracy") == "accuracy"
    assert layout.quantity("validation_loss") == "loss"
    assert layout.quantity("value") == "value", "'val' only as a whole word"
    assert layout.quantity("val") == "val"
    assert layout.best_direction("top5") == "max"
    assert layout.best_direction("epoch_time") is None


def test_a_layout_keeps_its_charts_and_colours_as_metrics_appear():
    first = layout.chart_layout(["acc"])
    later = layout.chart_layout(["loss", "acc", "val_acc"], first)
    assert [c["title"] for c in later["charts"]] == ["acc", "loss"], "acc stays first"
    assert later["charts"][0]["series"][0]["color"] == first["charts"][0]["series"][0]["color"]
    # a validation series that appears first still goes after the training one
    assert [s["name"] for s in layout.chart_layout(["val_loss", "loss"])["charts"][0]
            ["series"]] == ["loss", "val_loss"]


def test_epoch_lines_where_the_epoch_changed():
    assert layout.epoch_starts([0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 2]) == [2, 5]
    assert layout.epoch_starts([3], [0]) == []


def test_ticks_on_step_axes_are_whole_numbers():
    assert nice_ticks(0, 1, 4, whole=True) == [0, 1], "never 0.25, 0.5 steps"
    assert nice_ticks(0, 200_000, 4) == [0, 50_000, 100_000, 150_000, 200_000]
    assert nice_ticks(0.9, 0.98, 3) == pytest.approx([0.9, 0.95])
    assert nice_ticks(5, 5, 3) == [5]


def _svg_texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]


def test_static_chart_draws_train_and_validation_with_markers_and_the_best_point():
    series = {"loss": (list(range(100)), [1 / (s + 1) for s in range(100)]),
              "val_loss": ([49, 99], [0.05, 0.02]), "acc": ([0], [0.5])}
    lay = layout.chart_layout(list(series))
    loss = chart_svg(lay["charts"][0], series)
    texts = _svg_texts(loss)
    assert texts[:3] == ["loss", "loss: last 0.01 · smoothed 0.0102 · min 0.01",
                         "val_loss: last 0.02 · min 0.02"], "one chart, with a legend"
    assert loss.count("<polyline") == 3, "loss raw + smoothed, val_loss raw only (2 points)"
    assert loss.count('r="2.5"') == 2, "markers on the sparse series' two points"
    assert loss.count("<title>min of") == 2 and "min of val_loss: 0.02 at step 99" in loss
    ticks = texts[3:-1]
    assert texts[-1] == "step", "the x axis says what it is"
    assert "99" in ticks, "a final tick at the last step"
    assert all("." not in t for t in ticks if t.replace(",", "").isdigit()), texts
    one = chart_svg(lay["charts"][1], series)
    assert one.count('r="2.5"') == 1, "a one-point chart draws its point"
    assert _svg_texts(one)[1] == "acc: last 0.5", "one point: no min or max to speak of"
    assert not [t for t in _svg_texts(one)[2:] if "." in t and t != "0.5"], (
        "no fractional step ticks on a one-point chart")


def test_legend_says_what_each_number_is_in_one_format():
    assert legend_text("loss", [0.5, 0.00655, 0.139], 0.0812, "min") == (
        "loss: last 0.139 · smoothed 0.0812 · min 0.00655")
    assert legend_text("val_acc", [0.9, 0.976, 0.967], None, "max") == (
        "val_acc: last 0.967 · max 0.976")
    assert legend_text("lr", [0.1, 0.01], None, None) == "lr: last 0.01"


def test_static_legend_uses_the_readers_smoothing_and_wraps_onto_more_lines():
    steps = list(range(100))
    series = {"loss": (steps, [1.0] * 99 + [0.0])}
    chart = layout.chart_layout(list(series))["charts"][0]
    assert "smoothed 0.6" in chart_svg(chart, series, smoothing=0.6)
    assert "smoothed 0.9" in chart_svg(chart, series, smoothing=0.9)
    assert "smoothed" not in chart_svg(chart, series, smoothing=0.0)
    names = [f"loss_{k}_with_a_long_name" for k in range(5)]
    many = {n: (steps, [1 / (s + 1) for s in steps]) for n in names}
    plan = {"charts": [{"title": "loss", "series": [
        {"name": n, "color": "#000", "best": "min"} for n in names]}]}
    svg = chart_svg(plan["charts"][0], many)
    height = int(ET.fromstring(svg).get("height"))
    assert height > HEIGHT, "a legend that does not fit on one line takes more lines"
    bundle = fallback_bundle("k", many, {"points": 100}, plan)
    assert ET.fromstring(bundle["image/svg+xml"]).get("height") == str(22 + height)


def test_x_axis_ends_with_a_tick_at_the_last_step():
    assert x_ticks(0, 199, 199, 5, 536 / 199, whole=True) == [0, 50, 100, 150, 199]
    assert x_ticks(0, 160, 160, 4, 536 / 160, whole=True) == [0, 50, 100, 160], (
        "150 is too close to 160 to label both")
    assert x_ticks(0, 200, 200, 5, 2.5, whole=True) == [0, 50, 100, 150, 200]
    assert x_ticks(0, 1000, 620, 5, 0.5, whole=True) == [0, 200, 400, 620, 800, 1000]


def test_static_bundle_has_html_a_standalone_svg_and_text():
    stats = {"points": 3, "latest": {"loss": 0.25}, "steps_per_s": 190_000, "elapsed": 2.0,
             "step": 2, "total": None,
             "ranks": [{"rank": 0, "step_s": 0.08, "compute_s": 0.05, "straggler": False},
                       {"rank": 1, "step_s": 0.08, "compute_s": 0.07, "straggler": True}]}
    series = {"loss": ([0, 1, 2], [1.0, 0.5, 0.25]), "<acc>": ([2], [0.9])}
    bundle = fallback_bundle("abc123", series, stats)
    page = bundle["text/html"]
    assert 'class="ipydist-fallback ipydist-fallback-abc123 ipydist-after-abc123"' in page
    assert page.count("<svg") == 2
    assert "&lt;acc&gt;" in page and "<acc>" not in page, "names are escaped"
    assert "straggler" in page
    assert ":has(+ .jp-OutputArea-child .ipydist-after-abc123)" in page, (
        "the copy hides its own widget's 'model not found' box, and only that one")
    at_end = fallback_bundle("abc123", series, stats, below_widget=False)["text/html"]
    assert 'class="ipydist-fallback ipydist-fallback-abc123"' in at_end, (
        "a copy shown at the cell's end, not in the placeholder, is not taken for it: the "
        "output before it is a line, not the widget")
    image = ET.fromstring(bundle["image/svg+xml"])
    assert len(image.findall("{http://www.w3.org/2000/svg}g")) == 2, "both charts in one image"
    assert bundle["text/plain"] == (
        "[metrics] last: loss 0.25 · step 2 · 190 k steps/s · done in 0:02 · straggler: rank 1")
    assert 'title="time per step outside' in page, "the per-rank column says what it is"
    assert summary_line({"points": 1}) == ""
    assert summary_line({"latest": {"epoch": 19, "loss": 0.139}, "step": 199, "total": 200,
                         "elapsed": 15}) == (
        "last: epoch 19 · loss 0.139 · 200 of 200 steps · done in 0:15")


def test_static_chart_of_nothing_finite_is_an_empty_frame():
    chart = {"title": "loss", "series": [{"name": "loss", "color": "#000", "best": "min"}]}
    svg = chart_svg(chart, {"loss": ([0, 1], [math.nan, math.inf])})
    assert "<polyline" not in svg and _svg_texts(svg) == ["loss"]
