"""The static copy of a cell's metrics: a summary line and the charts, as HTML with inline SVG
and as one standalone SVG image.

It goes into the cell's output next to the widget, so a saved notebook shows the curves where
no widget can render: nbconvert's HTML, GitHub, a notebook reopened without its widget state.
Where the widget does render it hides this copy (by the class that carries the widget's key).
Where it cannot (JupyterLab or Notebook 7 reopening a notebook whose widget state was not
saved, their default), this copy hides the widget's "model not found" box instead, with a
style scoped to that one output (``:has``, in every browser JupyterLab supports).

The charts are drawn from the same :mod:`layout` as the widget's, with the same number
formatting (:mod:`numbers`) and smoothing, so the two read alike.
"""

from __future__ import annotations

import html
import math

from ipydist.notebook.live import layout as charts_layout
from ipydist.notebook.live.history import downsample_indices
from ipydist.notebook.live.numbers import count, duration, number, tick_labels

WIDTH, HEIGHT = 600, 162
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 22, 34
#: The widget's default smoothing (TensorBoard's), for series with enough points.
SMOOTHING = 0.6
#: Legend lines: how far apart, and about how wide a character of the 10 px legend font is.
LEGEND_LINE, LEGEND_CHAR = 13, 5.6
#: What the per-rank "outside collectives" time is (the widget's bar says the same).
OUTSIDE_COLLECTIVES = (
    "time per step outside ipydist's collectives (computing, loading data) on that rank; "
    "the rest of the step is spent waiting for the other ranks. The rank with the most is "
    "the one the others wait for (a straggler when well above the median).")
#: A nice tick closer than this (pixels) to the final tick (the last step) is left out.
FINAL_TICK_GAP = 40


def fallback_bundle(key: str, series: dict[str, tuple[list, list]], stats: dict,
                    charts: dict | None = None, smoothing: float = SMOOTHING,
                    below_widget: bool = True) -> dict:
    """The display bundle of the static copy: HTML for notebooks and nbconvert, a standalone
    SVG for renderers that drop HTML, and the summary as text. ``charts``: the widget's chart
    plan (``layout.chart_layout``); ``smoothing``: the reader's, as the widget drew it;
    ``below_widget``: it fills the placeholder right below the widget (False: it is a new
    output at the cell's end, where display updates are not applied)."""
    charts = charts or charts_layout.chart_layout(list(series))
    epochs = stats.get("epochs") or []
    xs = [x for steps, values in series.values() for x, y in zip(steps, values)
          if math.isfinite(y)]
    shared = (min(xs), max(xs)) if xs else None  # one x range: a step lines up on every chart
    drawn = [_chart(chart, series, epochs, x_range=shared, smoothing=smoothing)
             for chart in charts.get("charts", [])]
    summary = summary_line(stats)
    return {
        "text/html": _html(key, summary, [svg for svg, _ in drawn], stats, below_widget),
        "image/svg+xml": _stacked_svg(summary, drawn),
        "text/plain": f"[metrics] {summary}",
    }


def summary_line(stats: dict) -> str:
    """One line of text, as the widget's header reads: each metric's last value, how far the
    run got, rates, how long it took, stragglers."""
    latest = stats.get("latest", {})
    parts = []
    if latest:
        parts.append("last: " + " · ".join(f"{name} {number(v)}" for name, v in latest.items()))
    parts.extend(progress_parts(stats))
    if stats.get("steps_per_s"):
        parts.append(f"{number(stats['steps_per_s'])} steps/s")
    if stats.get("samples_per_s"):
        parts.append(f"{number(stats['samples_per_s'])} samples/s")
    if stats.get("elapsed"):
        parts.append(f"done in {duration(stats['elapsed'])}")
    stragglers = [r["rank"] for r in stats.get("ranks", []) if r.get("straggler")]
    if stragglers:
        parts.append("straggler: rank " + ", ".join(map(str, stragglers)))
    return " · ".join(parts)


def progress_parts(stats: dict) -> list[str]:
    """``["200 of 200 steps"]`` where the cell gave ``total`` (steps count from 0, so the
    last step 199 is the 200th), else ``["step 199"]``; nothing before the first point."""
    step, total = stats.get("step"), stats.get("total")
    if step is None:
        return []
    if total:
        return [f"{count(step + 1)} of {count(total)} steps"]
    return [f"step {count(step)}"]


def legend_text(name: str, values: list[float], smoothed: float | None,
                best: str | None) -> str:
    """One series' legend entry, in the widget's words: ``loss: last 0.139 · smoothed 0.0812 ·
    min 0.00655`` -- the last logged value, the smoothed curve's last value where a smoothed
    curve is drawn, and the lowest (``best="min"``) or highest logged value."""
    parts = [f"last {number(values[-1])}"]
    if smoothed is not None:
        parts.append(f"smoothed {number(smoothed)}")
    if best and len(values) > 1:
        parts.append(f"{best} {number(min(values) if best == 'min' else max(values))}")
    return f"{name}: {' · '.join(parts)}"


def x_ticks(x0: float, x1: float, last: float, target: int, px_per_unit: float,
            whole: bool) -> list[float]:
    """Nice ticks over ``x0..x1``, plus a final one at ``last`` (the last step drawn), with
    the nice ticks too close to it left out."""
    ticks = nice_ticks(x0, x1, target, whole=whole)
    if not x0 <= last <= x1 or last in ticks:
        return ticks
    kept = [t for t in ticks if abs(t - last) * px_per_unit >= FINAL_TICK_GAP]
    return sorted([*kept, last])


def chart_svg(chart: dict, series: dict[str, tuple[list, list]], epochs=(),
              max_points: int = 600, x_range: tuple | None = None,
              smoothing: float = SMOOTHING) -> str:
    """One chart of the plan (a title and one or more series) as an SVG element, over
    ``x_range`` (default: its own series' steps)."""
    return _chart(chart, series, epochs, max_points, x_range, smoothing)[0]


def _chart(chart: dict, series: dict[str, tuple[list, list]], epochs=(),
           max_points: int = 600, x_range: tuple | None = None,
           smoothing: float = SMOOTHING) -> tuple[str, int]:
    """:func:`chart_svg` and the SVG's height (taller where the legend needs more lines)."""
    finite, drawn = {}, {}
    for s in chart["series"]:
        xs, ys = series.get(s["name"], ([], []))
        points = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        if points:
            finite[s["name"]] = ([p[0] for p in points], [p[1] for p in points])
            drawn[s["name"]] = downsample_indices(finite[s["name"]][1], max_points)
    title = _text(LEFT, 13, chart["title"], weight="bold", size=12, fill="#222")
    if not drawn:
        return _svg(title), HEIGHT
    # The legend's numbers come from every point the widget has (not the drawn subset), so
    # both say the same; the smoothed curve is drawn from the same full series.
    smoothed = {name: smooth(ys, smoothing) if smoothing > 0
                and len(ys) >= charts_layout.SMOOTH_FROM else None
                for name, (_, ys) in finite.items()}
    legend, lines = _legend(chart, finite, smoothed)
    extra = (lines - 1) * LEGEND_LINE
    top, height = TOP + extra, HEIGHT + extra
    all_x = [finite[name][0][i] for name, keep in drawn.items() for i in keep]
    all_y = [finite[name][1][i] for name, keep in drawn.items() for i in keep]
    x0, x1 = x_range or (min(all_x), max(all_x))
    y0, y1 = min(all_y), max(all_y)
    last_x = max(all_x)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.1 - 0.5, y1 + abs(y1) * 0.1 + 0.5
    plot_w = WIDTH - LEFT - RIGHT

    def sx(x):
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y):
        return top + (1 - (y - y0) / (y1 - y0)) * (height - top - BOTTOM)

    parts = [title, legend]
    yt = nice_ticks(y0, y1, 4)
    for t, label in zip(yt, tick_labels(yt)):
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{sy(t):.1f}" '
                     f'y2="{sy(t):.1f}" stroke="#e6e6e6"/>')
        parts.append(_text(LEFT - 4, sy(t) + 3.5, label, anchor="end"))
    xt = x_ticks(x0, x1, last_x, 5, plot_w / (x1 - x0),
                 whole=all(float(x).is_integer() for x in all_x))
    for t, label in zip(xt, tick_labels(xt)):
        parts.append(_text(sx(t), height - BOTTOM + 14, label, anchor="middle"))
    parts.append(_text(LEFT + plot_w / 2, height - 4, "step", anchor="middle", fill="#444"))
    for e in epochs:
        if x0 <= e <= x1:
            parts.append(f'<line x1="{sx(e):.1f}" x2="{sx(e):.1f}" y1="{top}" '
                         f'y2="{height - BOTTOM}" stroke="#bbb" stroke-dasharray="2,3"/>')
    for s in chart["series"]:
        if s["name"] not in drawn:
            continue
        keep, (xs, ys), sm = drawn[s["name"]], finite[s["name"]], smoothed[s["name"]]
        xs, ys = [xs[i] for i in keep], [ys[i] for i in keep]
        parts.append(_series_svg(xs, ys, s["color"], sx, sy, sm and [sm[i] for i in keep]))
        if s["best"] and len(ys) > 1:
            i = ys.index(min(ys) if s["best"] == "min" else max(ys))
            parts.append(f'<circle cx="{sx(xs[i]):.1f}" cy="{sy(ys[i]):.1f}" r="4" '
                         f'fill="none" stroke="{s["color"]}" stroke-width="1.5">'
                         f'<title>{s["best"]} of {html.escape(s["name"])}: {number(ys[i])} '
                         f'at step {count(xs[i])}</title></circle>')
    return _svg("".join(parts), height), height


def _series_svg(xs, ys, color, sx, sy, smoothed) -> str:
    points = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
    out = []
    line = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    raw_style = 'stroke-width="1" opacity="0.3"' if smoothed else 'stroke-width="1.6"'
    out.append(f'<polyline fill="none" stroke="{color}" {raw_style} points="{line}"/>')
    if smoothed:
        line = " ".join(f"{px:.1f},{sy(y):.1f}" for (px, _), y in zip(points, smoothed))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{line}"/>')
    if len(points) <= charts_layout.MARKERS_UP_TO:
        out.extend(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="2.5" fill="{color}"/>'
                   for px, py in points)
    return "".join(out)


def smooth(ys: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start (the
    widget's ``smooth`` does the same)."""
    out, last = [], 0.0
    for n, y in enumerate(ys, 1):
        last = last * weight + (1 - weight) * y
        out.append(last / (1 - weight**n))
    return out


def nice_ticks(lo: float, hi: float, target: int, whole: bool = False) -> list[float]:
    """About ``target`` ticks between ``lo`` and ``hi`` at steps of 1, 2 or 5 times a power of
    ten (``whole``: never a fractional step, for step counts)."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next((k * magnitude for k in (1, 2, 5, 10) if k * magnitude >= raw), raw)
    if whole:
        step = max(1, round(step))
    first = math.ceil(lo / step - 1e-9)
    ticks, i = [], first
    while i * step <= hi + step * 1e-9:
        ticks.append(round(i * step, 12))
        i += 1
    return ticks


def _legend(chart: dict, finite: dict, smoothed: dict) -> tuple[str, int]:
    """Each series' :func:`legend_text` after the title, on as many lines as it needs; returns
    the SVG and the number of lines."""
    out, x, y, lines = [], LEFT + 8 + 7.5 * len(chart["title"]), 11, 1
    for s in chart["series"]:
        if s["name"] not in finite:
            continue
        sm = smoothed[s["name"]]
        text = legend_text(s["name"], finite[s["name"]][1], sm[-1] if sm else None, s["best"])
        width = 13 + LEGEND_CHAR * len(text)
        if x + width > WIDTH - RIGHT and x > LEFT:
            x, y, lines = LEFT, y + LEGEND_LINE, lines + 1
        out.append(f'<rect x="{x:.0f}" y="{y - 6}" width="10" height="3" fill="{s["color"]}"/>')
        out.append(_text(x + 13, y, text, anchor="start", fill="#444"))
        x += width + 14
    return "".join(out), lines


def _text(x, y, text, anchor="start", size=10, fill="#666", weight=None) -> str:
    bold = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{fill}" font-family="system-ui, sans-serif"{bold}>{html.escape(text)}</text>')


def _svg(body: str, height: float = HEIGHT) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" style="display:block">{body}</svg>')


def _stacked_svg(summary: str, drawn: list[tuple[str, int]]) -> str:
    """Every chart in one SVG image, the summary line above them."""
    body, y = [_text(4, 14, summary, size=11, fill="#222")], 22
    for svg, height in drawn:
        body.append(f'<g transform="translate(0,{y})">{svg}</g>')
        y += height
    return _svg("".join(body), height=y)


def placeholder_html(key: str) -> str:
    """The empty output displayed right below the widget, which the static copy fills (or,
    where display updates are not applied, only marks where the widget is)."""
    key = html.escape(key)
    return f'<div class="ipydist-fallback ipydist-fallback-{key} ipydist-after-{key}"></div>'


def _html(key: str, summary: str, svgs: list[str], stats: dict, below_widget: bool) -> str:
    key = html.escape(key)
    # In JupyterLab and Notebook 7, an output whose widget has no model (widget state not
    # saved) shows an error box. The widget's output is always the one right before the
    # placeholder (both are displayed at once), so this copy hides it unless the widget
    # rendered; the widget, where it renders, hides every element of class
    # ipydist-fallback-<key>, this copy included.
    hide_error = (
        f".jp-OutputArea-child:has(+ .jp-OutputArea-child .ipydist-after-{key})"
        ":not(:has(.ipydist-metrics)){display: none}"
    )
    after = f" ipydist-after-{key}" if below_widget else ""
    return (
        f'<div class="ipydist-fallback ipydist-fallback-{key}{after}" '
        'style="font-family: system-ui, sans-serif; font-size: 12px">'
        f"<style>{hide_error}</style>"
        f"<div>{html.escape(summary)}</div>{''.join(svgs)}{_ranks_table(stats)}</div>"
    )


def _ranks_table(stats: dict) -> str:
    rows = [r for r in stats.get("ranks", []) if r.get("step_s") is not None]
    if not rows:
        return ""
    cells = "".join(
        f"<tr><td>rank {r['rank']}</td><td>{number(r['step_s'] * 1000)} ms</td>"
        f"<td>{number((r['compute_s'] or 0) * 1000)} ms</td>"
        f"<td>{'straggler' if r['straggler'] else ''}</td></tr>"
        for r in rows
    )
    return ("<table><tr><th></th><th>step time</th>"
            f'<th title="{html.escape(OUTSIDE_COLLECTIVES)}">outside collectives</th><th></th>'
            f"</tr>{cells}</table>")
