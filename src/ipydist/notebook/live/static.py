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
from ipydist.notebook.live.history import downsample
from ipydist.notebook.live.numbers import count, number, tick_labels

WIDTH, HEIGHT = 600, 150
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 22, 22
#: The widget's default smoothing (TensorBoard's), for series with enough points.
SMOOTHING = 0.6


def fallback_bundle(key: str, series: dict[str, tuple[list, list]], stats: dict,
                    layout: dict | None = None) -> dict:
    """The display bundle of the static copy: HTML for notebooks and nbconvert, a standalone
    SVG for renderers that drop HTML, and the summary as text."""
    layout = layout or charts_layout.chart_layout(list(series))
    epochs = stats.get("epochs") or []
    xs = [x for steps, values in series.values() for x, y in zip(steps, values)
          if math.isfinite(y)]
    shared = (min(xs), max(xs)) if xs else None  # one x range: a step lines up on every chart
    svgs = [chart_svg(chart, series, epochs, x_range=shared) for chart in layout["charts"]]
    summary = summary_line(stats)
    return {
        "text/html": _html(key, summary, svgs, stats),
        "image/svg+xml": _stacked_svg(summary, svgs),
        "text/plain": f"[metrics] {summary}",
    }


def summary_line(stats: dict) -> str:
    """One line of text: latest values, rates, point count, duration."""
    parts = [f"{name} {number(v)}" for name, v in stats.get("latest", {}).items()]
    if stats.get("steps_per_s"):
        parts.append(f"{number(stats['steps_per_s'])} steps/s")
    if stats.get("samples_per_s"):
        parts.append(f"{number(stats['samples_per_s'])} samples/s")
    points = stats.get("points", 0)
    parts.append(f"{count(points)} point{'' if points == 1 else 's'}")
    if stats.get("elapsed"):
        parts.append(f"{number(stats['elapsed'])} s")
    stragglers = [r["rank"] for r in stats.get("ranks", []) if r.get("straggler")]
    if stragglers:
        parts.append("straggler: rank " + ", ".join(map(str, stragglers)))
    return " · ".join(parts)


def chart_svg(chart: dict, series: dict[str, tuple[list, list]], epochs=(),
              max_points: int = 600, x_range: tuple | None = None) -> str:
    """One chart of the layout (a title and one or more series) as an SVG element, over
    ``x_range`` (default: its own series' steps)."""
    drawn = {}
    for s in chart["series"]:
        xs, ys = series.get(s["name"], ([], []))
        finite = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        if finite:
            drawn[s["name"]] = downsample([p[0] for p in finite], [p[1] for p in finite],
                                          max_points)
    title = _text(LEFT, 13, chart["title"], weight="bold", size=12, fill="#222")
    if not drawn:
        return _svg(title)
    all_x = [x for xs, _ in drawn.values() for x in xs]
    all_y = [y for _, ys in drawn.values() for y in ys]
    x0, x1 = x_range or (min(all_x), max(all_x))
    y0, y1 = min(all_y), max(all_y)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - abs(y0) * 0.1 - 0.5, y1 + abs(y1) * 0.1 + 0.5

    def sx(x):
        return LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def sy(y):
        return TOP + (1 - (y - y0) / (y1 - y0)) * (HEIGHT - TOP - BOTTOM)

    parts = [title, _legend(chart, drawn)]
    yt = nice_ticks(y0, y1, 4)
    for t, label in zip(yt, tick_labels(yt)):
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{sy(t):.1f}" '
                     f'y2="{sy(t):.1f}" stroke="#e6e6e6"/>')
        parts.append(_text(LEFT - 4, sy(t) + 3.5, label, anchor="end"))
    xt = nice_ticks(x0, x1, 5, whole=all(float(x).is_integer() for x in all_x))
    for t, label in zip(xt, tick_labels(xt)):
        parts.append(_text(sx(t), HEIGHT - 6, label, anchor="middle"))
    for e in epochs:
        if x0 <= e <= x1:
            parts.append(f'<line x1="{sx(e):.1f}" x2="{sx(e):.1f}" y1="{TOP}" '
                         f'y2="{HEIGHT - BOTTOM}" stroke="#bbb" stroke-dasharray="2,3"/>')
    for s in chart["series"]:
        if s["name"] not in drawn:
            continue
        xs, ys = drawn[s["name"]]
        parts.append(_series_svg(xs, ys, s["color"], sx, sy))
        if s["best"] and len(ys) > 1:
            i = ys.index(min(ys) if s["best"] == "min" else max(ys))
            parts.append(f'<circle cx="{sx(xs[i]):.1f}" cy="{sy(ys[i]):.1f}" r="4" '
                         f'fill="none" stroke="{s["color"]}" stroke-width="1.5">'
                         f'<title>best {html.escape(s["name"])}: {number(ys[i])} at step '
                         f'{count(xs[i])}</title></circle>')
    return _svg("".join(parts))


def _series_svg(xs, ys, color, sx, sy) -> str:
    points = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
    out = []
    smoothed = smooth(ys, SMOOTHING) if len(ys) >= charts_layout.SMOOTH_FROM else None
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


def _legend(chart: dict, drawn: dict) -> str:
    """Each series' name, unless the chart has one series named as its title."""
    if len(drawn) < 2 and all(name == chart["title"] for name in drawn):
        return ""
    out, x = [], LEFT + 8 + 7.5 * len(chart["title"])
    for s in chart["series"]:
        if s["name"] in drawn:
            out.append(f'<rect x="{x:.0f}" y="5" width="10" height="3" fill="{s["color"]}"/>')
            out.append(_text(x + 13, 11, s["name"], anchor="start", fill="#444"))
            x += 24 + 6.5 * len(s["name"])
    return "".join(out)


def _text(x, y, text, anchor="start", size=10, fill="#666", weight=None) -> str:
    bold = f' font-weight="{weight}"' if weight else ""
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
            f'fill="{fill}" font-family="system-ui, sans-serif"{bold}>{html.escape(text)}</text>')


def _svg(body: str, height: int = HEIGHT) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" style="display:block">{body}</svg>')


def _stacked_svg(summary: str, svgs: list[str]) -> str:
    """Every chart in one SVG image, the summary line above them."""
    body = [_text(4, 14, summary, size=11, fill="#222")]
    for i, svg in enumerate(svgs):
        body.append(f'<g transform="translate(0,{22 + i * HEIGHT})">{svg}</g>')
    return _svg("".join(body), height=22 + HEIGHT * len(svgs))


def _html(key: str, summary: str, svgs: list[str], stats: dict) -> str:
    key = html.escape(key)
    # In JupyterLab and Notebook 7, an output whose widget has no model (widget state not
    # saved) shows an error box. The widget's output is always the one right before this
    # copy (both are displayed at once), so this copy hides it unless the widget rendered.
    hide_error = (
        f".jp-OutputArea-child:has(+ .jp-OutputArea-child .ipydist-fallback-{key})"
        ":not(:has(.ipydist-metrics)){display: none}"
    )
    return (
        f'<div class="ipydist-fallback ipydist-fallback-{key}" '
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
    return ("<table><tr><th></th><th>step time</th><th>outside collectives</th><th></th></tr>"
            f"{cells}</table>")
