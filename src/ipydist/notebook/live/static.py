"""The static copy of a cell's metrics: an HTML summary with an SVG chart per metric.

It goes into the cell's output next to the widget, so a saved notebook shows the curves where
no widget can render: nbconvert's HTML, GitHub, a notebook opened without its widget state.
Where the widget does render it hides this copy (by the class that carries the widget's key).
"""

from __future__ import annotations

import html
import math

from ipydist.notebook.live.history import downsample

WIDTH, HEIGHT = 560, 140
LEFT, RIGHT, TOP, BOTTOM = 58, 10, 24, 22
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf"]


def fallback_html(key: str, series: dict[str, tuple[list, list]], stats: dict) -> str:
    """The whole static copy: summary line, charts, per-rank step times."""
    charts = "".join(
        chart_svg(name, xs, ys, COLORS[i % len(COLORS)])
        for i, (name, (xs, ys)) in enumerate(series.items())
    )
    return (
        f'<div class="ipydist-fallback ipydist-fallback-{html.escape(key)}" '
        'style="font-family: system-ui, sans-serif; font-size: 12px">'
        f"<div>{html.escape(summary_line(stats))}</div>{charts}{_ranks_table(stats)}</div>"
    )


def summary_line(stats: dict) -> str:
    """One line of text: latest values, rates, point count, duration."""
    parts = [f"{name} {fmt(v)}" for name, v in stats.get("latest", {}).items()]
    if stats.get("steps_per_s"):
        parts.append(f"{fmt(stats['steps_per_s'])} steps/s")
    if stats.get("samples_per_s"):
        parts.append(f"{fmt(round(stats['samples_per_s']))} samples/s")
    parts.append(f"{stats.get('points', 0):,} points")
    if stats.get("elapsed"):
        parts.append(f"{stats['elapsed']:.1f} s")
    stragglers = [r["rank"] for r in stats.get("ranks", []) if r.get("straggler")]
    if stragglers:
        parts.append("straggler: rank " + ", ".join(map(str, stragglers)))
    return " · ".join(parts)


def chart_svg(name: str, xs: list, ys: list, color: str, max_points: int = 600) -> str:
    """A line chart as an SVG string, with the y range and x range labelled."""
    points = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    title = f'<text x="{LEFT}" y="12" font-weight="bold">{html.escape(name)}</text>'
    if not points:
        return _svg(title)
    xs, ys = downsample([p[0] for p in points], [p[1] for p in points], max_points)
    x0, x1 = xs[0], xs[-1] if xs[-1] != xs[0] else xs[0] + 1
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x):
        return LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def sy(y):
        return TOP + (1 - (y - y0) / (y1 - y0)) * (HEIGHT - TOP - BOTTOM)

    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    grid = "".join(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" '
        f'stroke="#e0e0e0"/><text x="{LEFT - 4}" y="{sy(v) + 4:.1f}" text-anchor="end" '
        f'font-size="10" fill="#666">{v:.3g}</text>'
        for v in (y0, y1)
    )
    axis = "".join(
        f'<text x="{sx(v):.1f}" y="{HEIGHT - 6}" text-anchor="{anchor}" font-size="10" '
        f'fill="#666">{fmt(v)}</text>'
        for v, anchor in ((x0, "start"), (xs[-1], "end"))
    )
    body = (f'{title}{grid}{axis}<polyline fill="none" stroke="{color}" stroke-width="1.5" '
            f'points="{line}"/>')
    return _svg(body)


def _svg(body: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" style="display:block">{body}</svg>')


def _ranks_table(stats: dict) -> str:
    rows = [r for r in stats.get("ranks", []) if r.get("step_s") is not None]
    if not rows:
        return ""
    cells = "".join(
        f"<tr><td>rank {r['rank']}</td><td>{fmt(r['step_s'] * 1000)} ms</td>"
        f"<td>{fmt((r['compute_s'] or 0) * 1000)} ms</td>"
        f"<td>{'straggler' if r['straggler'] else ''}</td></tr>"
        for r in rows
    )
    return ("<table><tr><th></th><th>step time</th><th>outside collectives</th><th></th></tr>"
            f"{cells}</table>")


def fmt(v) -> str:
    """A number in a few significant digits, as the widget shows it."""
    if v is None or not math.isfinite(v):
        return "–"
    a = abs(v)
    if a and (a >= 1e5 or a < 1e-3):
        return f"{v:.2e}"
    if float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:.4g}"
