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
from ipydist.notebook.live.static import chart_svg, fallback_bundle, nice_ticks, summary_line

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
    assert texts[0] == "loss" and "val_loss" in texts, "one chart, with a legend"
    assert loss.count("<polyline") == 3, "loss raw + smoothed, val_loss raw only (2 points)"
    assert loss.count('r="2.5"') == 2, "markers on the sparse series' two points"
    assert loss.count("<title>best") == 2 and "best val_loss: 0.02 at step 99" in loss
    assert all("." not in t for t in texts[texts.index("val_loss") + 1:]
               if t.replace(",", "").isdigit()), texts
    one = chart_svg(lay["charts"][1], series)
    assert one.count('r="2.5"') == 1, "a one-point chart draws its point"
    assert not [t for t in _svg_texts(one) if "." in t and t not in ("0.5",)], (
        "no fractional step ticks on a one-point chart")


def test_static_bundle_has_html_a_standalone_svg_and_text():
    stats = {"points": 3, "latest": {"loss": 0.25}, "steps_per_s": 190_000, "elapsed": 2.0,
             "ranks": [{"rank": 0, "step_s": 0.08, "compute_s": 0.05, "straggler": False},
                       {"rank": 1, "step_s": 0.08, "compute_s": 0.07, "straggler": True}]}
    series = {"loss": ([0, 1, 2], [1.0, 0.5, 0.25]), "<acc>": ([2], [0.9])}
    bundle = fallback_bundle("abc123", series, stats)
    page = bundle["text/html"]
    assert 'class="ipydist-fallback ipydist-fallback-abc123"' in page
    assert page.count("<svg") == 2
    assert "&lt;acc&gt;" in page and "<acc>" not in page, "names are escaped"
    assert "straggler" in page
    assert ":has(+ .jp-OutputArea-child .ipydist-fallback-abc123)" in page, (
        "the copy hides its own widget's 'model not found' box, and only that one")
    image = ET.fromstring(bundle["image/svg+xml"])
    assert len(image.findall("{http://www.w3.org/2000/svg}g")) == 2, "both charts in one image"
    assert bundle["text/plain"] == (
        "[metrics] loss 0.25 · 190 k steps/s · 3 points · 2 s · straggler: rank 1")
    assert summary_line({"points": 1}) == "1 point"


def test_static_chart_of_nothing_finite_is_an_empty_frame():
    chart = {"title": "loss", "series": [{"name": "loss", "color": "#000", "best": "min"}]}
    svg = chart_svg(chart, {"loss": ([0, 1], [math.nan, math.inf])})
    assert "<polyline" not in svg and _svg_texts(svg) == ["loss"]
