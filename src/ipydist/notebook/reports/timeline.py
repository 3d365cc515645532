"""``%dist_timeline``: every rank's recorded collectives, drawn under the cell and written as
one Chrome trace (for chrome://tracing or https://ui.perfetto.dev).

The drawing is a static SVG (no JavaScript, so it survives a saved notebook): one row per
rank and lane (data, call check), one bar per event, its tooltip the event's name, duration
and arguments, a colour legend and a time axis with round ticks that cuts long idle
stretches short (:mod:`ipydist.notebook.reports.timeline_axis` says why); and a table of where the
time went, by event. Plain text where there is no HTML.

Names: the notebook calls an event by its collective (``allreduce``) and the check that every
rank makes the same call by ipydist's name for it (``allreduce call check``). Only the Chrome
trace keeps Horovod's names (``ALLREDUCE``, ``NEGOTIATE_ALLREDUCE``), for the tools that
read Horovod's timelines.
"""

from __future__ import annotations

import html
from collections import defaultdict
from typing import NamedTuple

from ipydist import protocol
from ipydist.errors import wrap_message
from ipydist.notebook.reports.timeline_axis import Axis, duration_text

_WIDTH, _LABEL, _ROW, _BAR = 900, 125, 18, 12
#: Bar colours by collective; every call check is grey, whatever it checks.
_COLOURS = {"allreduce": "#4c78a8", "allgather": "#f58518", "broadcast": "#54a24b",
            "alltoall": "#b279a2", "reducescatter": "#e45756"}
_OTHER, _CHECK, _BREAK = "#888888", "#bab0ac", "#f2f2f2"
CHECK = "call check"
_LANES = {protocol.TIMELINE_DATA_LANE: "data", protocol.TIMELINE_CHECK_LANE: CHECK}


def shown_name(name: str) -> str:
    """An event's name as the notebook shows it: Horovod's ``NEGOTIATE_ALLREDUCE`` is the
    ``allreduce call check``, ``ALLREDUCE`` the ``allreduce``."""
    checked = name.startswith(protocol.TIMELINE_CHECK_PREFIX)
    op = (name[len(protocol.TIMELINE_CHECK_PREFIX):] if checked else name).lower()
    op = op.replace("_", " ")
    return f"{op} {CHECK}" if checked else op


class Row(NamedTuple):
    """One line of the table: an event, over every rank."""

    event: str
    #: calls on the rank with the fewest and on the one with the most (equal on every rank
    #: that made the same calls)
    calls: tuple[int, int]
    #: time in it on one rank, averaged over the ranks (ms)
    ms_per_rank: float
    #: the mean length of one call (ms)
    ms_per_call: float
    #: the longest single call (ms), and the rank that made it
    longest_ms: float
    longest_rank: int

    @property
    def calls_text(self) -> str:
        low, high = self.calls
        return str(low) if low == high else f"{low}-{high}"


#: The table's columns, plain and as HTML headers.
COLUMNS = ("event", "calls per rank", "ms per rank", "ms per call", "longest call ms")


class Timeline:
    """Every rank's events (rank order), shown as an SVG and a table."""

    def __init__(self, per_rank: list[list[dict]], path: str | None = None) -> None:
        self.per_rank, self.path = per_rank, path

    @property
    def empty(self) -> bool:
        return not any(self.per_rank)

    def summary(self) -> list[Row]:
        """One :class:`Row` per event name (as the notebook names it), the most time first."""
        ranks = max(len(self.per_rank), 1)
        calls: dict[str, list[int]] = defaultdict(lambda: [0] * ranks)
        total: dict[str, float] = defaultdict(float)
        longest: dict[str, tuple[float, int]] = defaultdict(lambda: (-1.0, 0))
        for rank, mine in enumerate(self.per_rank):
            for e in mine:
                name, ms = shown_name(e["name"]), e["dur"] / 1000
                calls[name][rank] += 1
                total[name] += ms
                longest[name] = max(longest[name], (ms, -rank))
        rows = [Row(n, (min(c), max(c)), total[n] / ranks, total[n] / sum(c),
                    longest[n][0], -longest[n][1]) for n, c in calls.items()]
        return sorted(rows, key=lambda row: -row.ms_per_rank)

    def _table_note(self) -> str:
        return (f"{len(self.per_rank)} ranks. calls per rank: each rank's count (a range where "
                "ranks differ); ms per rank: time in it on one rank, averaged over the ranks; "
                "ms per call: the mean call; longest call: the longest one call, and its rank.")

    def _trace_note(self) -> str:
        return (f"Chrome trace: {self.path} (chrome://tracing or ui.perfetto.dev; there the "
                f"call checks keep Horovod's name, NEGOTIATE_<OP>)")

    def __repr__(self) -> str:
        if self.empty:
            return "no collectives recorded"
        table = [COLUMNS, *(_cells(r) for r in self.summary())]
        widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(row, widths))) for row in table]
        notes = [self._table_note(), self._trace_note() if self.path else ""]
        lines += [line for note in notes if note for line in wrap_message(note)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        if self.empty:
            return "<p>no collectives recorded</p>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _cells(r))
                       + "</tr>" for r in self.summary())
        where = f"<p>{html.escape(self._trace_note())}</p>" if self.path else ""
        return (f"{self.svg()}<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>"
                f"</table><p>{html.escape(self._table_note())}</p>{where}")

    def svg(self) -> str:
        """The events as bars: one row per rank and lane, time from the first event."""
        origin = min(e["ts"] for mine in self.per_rank for e in mine)
        axis = Axis.fit([(e["ts"] - origin, e["ts"] - origin + e["dur"])
                         for mine in self.per_rank for e in mine], _LABEL, _WIDTH - _LABEL - 15)
        used = {e.get("tid") for mine in self.per_rank for e in mine}
        lanes = [(r, lane) for r in range(len(self.per_rank)) for lane in _LANES if lane in used]
        bottom = _ROW * len(lanes) + 2
        ticks, unit = axis.ticks()
        parts = [_grid(ticks, bottom), _break_bands(axis, bottom)]
        kinds: set[str] = set()
        for i, (rank, lane) in enumerate(lanes):
            y = i * _ROW
            parts.append(_text(2, y + _BAR, f"rank {rank} {_LANES[lane]}"))
            for e in self.per_rank[rank]:
                if e.get("tid") == lane:
                    parts.append(_bar(e, rank, origin, axis, y, kinds))
        parts.append(_break_marks(axis, bottom))
        parts.append(_axis(ticks, unit, axis, bottom))
        parts.append(_legend(kinds, axis, bottom + 48))
        height = bottom + 64
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
                f'viewBox="0 0 {_WIDTH} {height}" font-family="sans-serif" font-size="11">'
                + "".join(parts) + "</svg>")


def _cells(r: Row) -> tuple[str, ...]:
    return (r.event, r.calls_text, f"{r.ms_per_rank:.2f}", f"{r.ms_per_call:.3f}",
            f"{r.longest_ms:.3f} (rank {r.longest_rank})")


def _colour(name: str) -> tuple[str, str]:
    """(legend entry, colour) of an event shown as ``name``."""
    if name.endswith(CHECK):
        return CHECK, _CHECK
    return (name, _COLOURS[name]) if name in _COLOURS else ("other", _OTHER)


def _bar(e: dict, rank: int, origin: float, axis: Axis, y: float, kinds: set[str]) -> str:
    name = shown_name(e["name"])
    kind, fill = _colour(name)
    kinds.add(kind)
    start = e["ts"] - origin
    x0, x1 = axis.x(start), axis.x(start + e["dur"])
    args = ", ".join(f"{k}={v}" for k, v in e.get("args", {}).items())
    tip = (f"rank {rank}: {name}, {duration_text(e['dur'])} from "
           f"{duration_text(start)}" + (f" ({args})" if args else ""))
    return (f'<rect x="{x0:.1f}" y="{y + 2}" width="{max(x1 - x0, 0.5):.1f}" height="{_BAR}" '
            f'fill="{fill}"><title>{html.escape(tip)}</title></rect>')


def _grid(ticks: list[tuple[float, str]], bottom: float) -> str:
    return "".join(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{bottom}" stroke="#eee"/>'
                   for x, _ in ticks)


def _break_bands(axis: Axis, bottom: float) -> str:
    """Behind the bars: each cut stretch as a pale band, its length in its tooltip."""
    out = []
    for a, b in axis.breaks:
        x0, x1 = axis.x(a), axis.x(b)
        tip = html.escape(f"{duration_text(b - a)} in which no event starts or ends, cut short")
        out.append(f'<rect x="{x0:.1f}" y="0" width="{x1 - x0:.1f}" height="{bottom + 4}" '
                   f'fill="{_BREAK}"><title>{tip}</title></rect>')
    return "".join(out)


def _break_marks(axis: Axis, bottom: float) -> str:
    """Over the bars: two white slashes through each cut (a bar across it shows the cut),
    two dark ones on the axis, and the length left out under it."""
    out, last = [], -1e9
    for a, b in axis.breaks:
        x0, x1 = axis.x(a), axis.x(b)
        mid = (x0 + x1) / 2
        for dx in ((mid - 5, mid + 1) if x1 - x0 >= 12 else (mid - 2,)):
            out.append(f'<line x1="{dx:.1f}" y1="{bottom}" x2="{dx + 4:.1f}" y2="0" '
                       'stroke="#fff" stroke-width="1.5"/>')
            out.append(f'<line x1="{dx:.1f}" y1="{bottom + 8}" x2="{dx + 4:.1f}" '
                       f'y2="{bottom}" stroke="#666"/>')
        if mid - last > 60:
            out.append(_text(mid, bottom + 28, f"+{duration_text(b - a)}", "middle", "#999"))
            last = mid
    return "".join(out)


def _axis(ticks: list[tuple[float, str]], unit: str, axis: Axis, bottom: float) -> str:
    out = [f'<line x1="{axis.left}" y1="{bottom + 4}" x2="{axis.left + axis.width}" '
           f'y2="{bottom + 4}" stroke="#999"/>']
    for x, label in ticks:
        out.append(f'<line x1="{x:.1f}" y1="{bottom + 4}" x2="{x:.1f}" y2="{bottom + 8}" '
                   'stroke="#999"/>')
        out.append(_text(x, bottom + 18, label, "middle"))
    cut = "; +N: a stretch with no event, cut short" if axis.breaks else ""
    out.append(_text(axis.left + axis.width, bottom + 40,
                     f"time from the first event ({unit}){cut}", "end", "#444"))
    return "".join(out)


def _legend(kinds: set[str], axis: Axis, y: float) -> str:
    order = [*_COLOURS, "other", CHECK]
    out, x = [_text(2, y + 9, "colours:", fill="#444")], float(_LABEL)
    for kind in sorted(kinds, key=order.index):
        fill = _COLOURS.get(kind, _CHECK if kind == CHECK else _OTHER)
        out.append(f'<rect x="{x:.0f}" y="{y}" width="12" height="10" fill="{fill}"/>')
        out.append(_text(x + 16, y + 9, kind))
        x += 28 + 6.5 * len(kind)
    if axis.breaks:
        out.append(f'<rect x="{x:.0f}" y="{y}" width="12" height="10" fill="{_BREAK}" '
                   'stroke="#999"/>')
        out.append(_text(x + 16, y + 9, "cut-short idle stretch"))
    return "".join(out)


def _text(x: float, y: float, text: str, anchor: str = "start", fill: str = "#000") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}">'
            f"{html.escape(text)}</text>")


def save(per_rank: list[list[dict]], path: str) -> str:
    """Write every rank's events as one Chrome trace at ``path``; returns ``path``."""
    protocol.write_json(path, protocol.chrome_trace(per_rank))
    return path
