"""``%dist_timeline``: every rank's recorded collectives, drawn under the cell and written as
one Chrome trace (for chrome://tracing or https://ui.perfetto.dev).

The drawing is a static SVG (no JavaScript, so it survives a saved notebook): one row per
rank and lane (data, check), one bar per event, its tooltip the event's name, duration
and arguments; and a table of where the time went, by event name. Plain text where there is
no HTML.
"""

from __future__ import annotations

import html
from collections import defaultdict

from ipydist import protocol

_WIDTH, _LABEL, _ROW, _BAR = 900, 110, 18, 12
#: Bar colours by the event's kind (the name up to its first underscore, NEGOTIATE apart).
_COLOURS = {"ALLREDUCE": "#4c78a8", "ALLGATHER": "#f58518", "BROADCAST": "#54a24b",
            "ALLTOALL": "#b279a2", "REDUCESCATTER": "#e45756", "NEGOTIATE": "#bab0ac"}


class Timeline:
    """Every rank's events (rank order), shown as an SVG and a table."""

    def __init__(self, per_rank: list[list[dict]], path: str | None = None) -> None:
        self.per_rank, self.path = per_rank, path

    @property
    def empty(self) -> bool:
        return not any(self.per_rank)

    def summary(self) -> list[tuple[str, int, float, float]]:
        """(name, events, total ms, longest ms) over every rank, the most time first."""
        count: dict[str, int] = defaultdict(int)
        total: dict[str, float] = defaultdict(float)
        longest: dict[str, float] = defaultdict(float)
        for mine in self.per_rank:
            for e in mine:
                count[e["name"]] += 1
                total[e["name"]] += e["dur"] / 1000
                longest[e["name"]] = max(longest[e["name"]], e["dur"] / 1000)
        return sorted(((n, count[n], total[n], longest[n]) for n in count),
                      key=lambda row: -row[2])

    def __repr__(self) -> str:
        if self.empty:
            return "no collectives recorded"
        lines = [f"{'event':<28} {'count':>7} {'total ms':>10} {'longest ms':>11}"]
        lines += [f"{n:<28} {c:>7} {t:>10.2f} {m:>11.2f}" for n, c, t, m in self.summary()]
        if self.path:
            lines.append(f"Chrome trace: {self.path} (chrome://tracing or ui.perfetto.dev)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if self.empty:
            return "<p>no collectives recorded</p>"
        rows = "".join(
            f"<tr><td>{html.escape(n)}</td><td>{c}</td><td>{t:.2f}</td><td>{m:.2f}</td></tr>"
            for n, c, t, m in self.summary())
        where = (f"<p>Chrome trace: <code>{html.escape(self.path)}</code> (open it in "
                 "chrome://tracing or https://ui.perfetto.dev)</p>") if self.path else ""
        return (self.svg() + "<table><tr><th>event</th><th>count</th><th>total ms</th>"
                f"<th>longest ms</th></tr>{rows}</table>{where}")

    def svg(self) -> str:
        """The events as bars: one row per rank and lane, time from the first event."""
        starts = [e["ts"] for mine in self.per_rank for e in mine]
        ends = [e["ts"] + e["dur"] for mine in self.per_rank for e in mine]
        origin, span = min(starts), max(max(ends) - min(starts), 1.0)
        scale = (_WIDTH - _LABEL - 10) / span
        lanes = [(r, lane) for r in range(len(self.per_rank))
                 for lane in (protocol.TIMELINE_DATA_LANE, protocol.TIMELINE_CHECK_LANE)]
        height = _ROW * len(lanes) + 24
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
                 'font-family="sans-serif" font-size="11">']
        for i, (rank, lane) in enumerate(lanes):
            y = i * _ROW
            label = f"rank {rank} {'data' if lane == protocol.TIMELINE_DATA_LANE else 'check'}"
            parts.append(f'<text x="2" y="{y + _BAR}">{label}</text>')
            for e in self.per_rank[rank]:
                if e.get("tid") != lane:
                    continue
                x = _LABEL + (e["ts"] - origin) * scale
                w = max(e["dur"] * scale, 0.5)
                kind = e["name"].split("_")[0]
                tip = html.escape(f"{e['name']} {e['dur'] / 1000:.3f} ms {e.get('args', {})}")
                parts.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{_BAR}" '
                             f'fill="{_COLOURS.get(kind, "#888")}"><title>{tip}</title></rect>')
        axis = len(lanes) * _ROW + 14
        parts.append(f'<text x="{_LABEL}" y="{axis}">0 ms</text>'
                     f'<text x="{_WIDTH - 10}" y="{axis}" text-anchor="end">'
                     f'{span / 1000:.1f} ms</text></svg>')
        return "".join(parts)


def save(per_rank: list[list[dict]], path: str) -> str:
    """Write every rank's events as one Chrome trace at ``path``; returns ``path``."""
    protocol.write_json(path, protocol.chrome_trace(per_rank))
    return path
