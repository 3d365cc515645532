"""Which metric goes on which chart, in which colour, and which way is better: pure logic.

Both views draw from it -- the live widget (sent as its ``charts`` trait, so a saved notebook
keeps the order and colours it was drawn with) and the static copy -- so they always agree.

- Series of one quantity share a chart: ``loss``, ``val_loss`` and ``test_loss`` on the chart
  "loss", so training and validation are read against one x axis.
- Colours follow the order names first appear and never change while the cell runs.
- A name says whether lower (loss, error) or higher (accuracy) is better; the best point is
  marked. Names that say neither get no marker.
- ``epoch`` is not charted: where it changes, every chart gets a faint vertical line.
"""

from __future__ import annotations

import re

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
          "#e377c2"]
#: A series with at most this many points is drawn with a marker on each point.
MARKERS_UP_TO = 60
#: Smoothing applies only to series with at least this many points: on fewer, an average
#: lags far behind the values (0.90 shown for a true 0.976 on 6 points).
SMOOTH_FROM = 50
#: Logged with ``epoch=``: drawn as vertical lines, not as a chart.
EPOCH = "epoch"

_SPLIT = re.compile(
    r"^(?:(?P<pre>train|training|val|valid|validation|test|eval)[_/.\-])?(?P<base>.+?)"
    r"(?:[_/.\-](?P<post>train|training|val|valid|validation|test|eval))?$",
    re.IGNORECASE,
)
_LOWER_BETTER = re.compile(r"loss|err|mse|mae|rmse|nll|perplexity|ppl|wer|cer|regret|dist",
                           re.IGNORECASE)
_HIGHER_BETTER = re.compile(r"acc|f1|precision|recall|auc|iou|map|bleu|rouge|score|r2|reward"
                            r"|top\d", re.IGNORECASE)


def quantity(name: str) -> str:
    """The quantity a metric measures, without its split: ``val_loss`` -> ``loss``."""
    match = _SPLIT.match(name)
    return match.group("base") if match else name


def best_direction(name: str) -> str | None:
    """``"min"`` for loss-like names, ``"max"`` for accuracy-like ones, else None."""
    base = quantity(name)
    if _LOWER_BETTER.search(base):
        return "min"
    if _HIGHER_BETTER.search(base):
        return "max"
    return None


def chart_layout(names: list[str], before: dict | None = None) -> dict:
    """Charts for metric ``names`` (in the order they first appeared).

    ``before``: an earlier layout of the same cell, whose charts and colours are kept so that
    nothing moves or changes colour as new metrics appear. Returns ``{"charts": [{"title",
    "series": [{"name", "color", "best"}]}], "epoch": bool, "markers_up_to", "smooth_from"}``.
    """
    charts: list[dict] = [
        {"title": c["title"], "series": [dict(s) for s in c["series"]]}
        for c in (before or {}).get("charts", [])
    ]
    by_title = {c["title"]: c for c in charts}
    placed = {s["name"] for c in charts for s in c["series"]}
    used = len(placed)
    for name in names:
        if name in placed or name == EPOCH:
            continue
        title = quantity(name)
        chart = by_title.get(title)
        if chart is None:
            chart = by_title[title] = {"title": title, "series": []}
            charts.append(chart)
        chart["series"].append({"name": name, "color": COLORS[used % len(COLORS)],
                                "best": best_direction(name)})
        placed.add(name)
        used += 1
    for chart in charts:  # the training series first, then validation, test, ...
        chart["series"].sort(key=lambda s: (_split_order(s["name"])))
    return {"charts": charts, "epoch": EPOCH in names, "markers_up_to": MARKERS_UP_TO,
            "smooth_from": SMOOTH_FROM}


def _split_order(name: str) -> int:
    match = _SPLIT.match(name)
    split = ((match.group("pre") or match.group("post") or "") if match else "").lower()
    return {"": 0, "train": 0, "training": 0, "val": 1, "valid": 1, "validation": 1,
            "eval": 2, "test": 3}.get(split, 4)


def epoch_starts(steps: list, epochs: list) -> list:
    """The steps where a new epoch began (where the logged ``epoch`` changed), for the
    vertical lines; the first epoch's start is the chart's left edge and gets none."""
    return [step for step, before, now in zip(steps[1:], epochs, epochs[1:]) if now != before]
