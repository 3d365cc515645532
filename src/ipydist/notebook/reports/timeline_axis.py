"""The time axis of ``%dist_timeline``'s drawing: linear, with long idle stretches cut short.

One long wait (a cell that ran minutes after the last one, a rank that slept while the others
sat in a call check) would, on a plain linear axis, squeeze every other bar to a hairline. A
log scale would keep them visible but make no two bars comparable, and a second, zoomed drawing
would need someone to choose what to zoom on. So the axis is broken instead, as charts with a
gap are drawn on paper: a stretch in which no event on any rank starts or ends is drawn as a
narrow break when it is both long against the events (``LONG_AGAINST_EVENTS`` times the median
one) and long against the whole recording (``LONG_AGAINST_SPAN`` of it). Everything between
breaks keeps one linear scale, so bars there compare as they are; a bar across a break shows
the break on it, and its tooltip its true length. Regular gaps (the compute between training
steps) stay as they are: there are many, so none is a large part of the whole.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

#: A stretch without events is cut short when longer than this many median events...
LONG_AGAINST_EVENTS = 25
#: ... and than this part of the whole recording.
LONG_AGAINST_SPAN = 1 / 50
#: How wide a break is drawn (px), and the most of the drawing that breaks may take.
BREAK_PX, BREAKS_SHARE = 20.0, 0.25
#: The least room between two time labels (px).
TICK_PX = 70


@dataclass
class Axis:
    """Microseconds from the first event to x pixels (``left`` to ``left + width``)."""

    left: float
    width: float
    #: (start, end) of each stretch drawn as a break, in µs from the first event, in order.
    breaks: list[tuple[float, float]] = field(default_factory=list)
    span: float = 1.0
    break_px: float = BREAK_PX
    scale: float = 1.0  # px per µs on the linear parts

    @classmethod
    def fit(cls, spans: list[tuple[float, float]], left: float, width: float) -> Axis:
        """The axis for events running over ``spans`` ((start, end) µs from the first)."""
        points = sorted({p for s in spans for p in s} | {0.0})
        span = max(points[-1], 1.0)
        durations = [e - s for s, e in spans if e > s]
        typical = statistics.median(durations) if durations else span
        long = max(LONG_AGAINST_EVENTS * typical, LONG_AGAINST_SPAN * span)
        breaks = [(a, b) for a, b in zip(points, points[1:]) if b - a > long]
        break_px = min(BREAK_PX, BREAKS_SHARE * width / len(breaks)) if breaks else BREAK_PX
        linear = span - sum(b - a for a, b in breaks)
        scale = (width - break_px * len(breaks)) / max(linear, 1e-9)
        return cls(left, width, breaks, span, break_px, scale)

    def x(self, t: float) -> float:
        """The pixel of time ``t`` (µs from the first event); inside a break, its share of it."""
        cut = 0.0
        for i, (a, b) in enumerate(self.breaks):
            if t < b:
                before = self.left + (min(t, a) - cut) * self.scale + i * self.break_px
                return before + (self.break_px * (t - a) / (b - a) if t > a else 0.0)
            cut += b - a
        return self.left + (t - cut) * self.scale + len(self.breaks) * self.break_px

    def ticks(self) -> tuple[list[tuple[float, str]], str]:
        """(x, label) of round times on the linear parts, at least ``TICK_PX`` apart, and the
        unit they are in (``"ms"`` or ``"s"``)."""
        step = _nice(TICK_PX / self.scale)
        unit, per = ("s", 1e6) if step >= 1e6 else ("ms", 1e3)
        decimals = max(0, -math.floor(math.log10(step / per) + 1e-9))
        out: list[tuple[float, str]] = []
        starts = [0.0] + [b for _, b in self.breaks]
        ends = [a for a, _ in self.breaks] + [self.span]
        for lo, hi in zip(starts, ends):
            t = math.ceil(lo / step - 1e-9) * step
            while t <= hi + 1e-6:
                x = self.x(t)
                if not out or x - out[-1][0] >= TICK_PX * 0.6:
                    out.append((x, f"{t / per:,.{decimals}f}"))
                t += step
        return out, unit


def _nice(raw: float) -> float:
    """The least of 1, 2 or 5 times a power of ten that is at least ``raw``."""
    magnitude = 10 ** math.floor(math.log10(max(raw, 1e-9)))
    return next(k * magnitude for k in (1, 2, 5, 10) if k * magnitude >= raw * (1 - 1e-9))


def duration_text(us: float) -> str:
    """A length of time as a person writes it: ``850 µs``, ``12.3 ms``, ``4.5 s``, ``3.2 min``."""
    if us < 1e3:
        return f"{us:.0f} µs"
    if us < 1e6:
        return f"{us / 1e3:.3g} ms"
    if us < 60e6:
        return f"{us / 1e6:.3g} s"
    return f"{us / 60e6:.3g} min"
