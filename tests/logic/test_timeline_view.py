"""``%dist_timeline``'s drawing and table, from made-up events (pure logic: no ranks).

What a user reads must use one vocabulary (the "call check", not Horovod's ``NEGOTIATE_``,
which only the Chrome trace keeps), count calls per rank, show a legend and a time axis with
round ticks, and keep short bars visible when one wait is very long.
"""

from __future__ import annotations

import re

from ipydist import protocol
from ipydist.notebook.reports.timeline import Timeline, shown_name
from ipydist.notebook.reports.timeline_axis import Axis

DATA, CHECK = protocol.TIMELINE_DATA_LANE, protocol.TIMELINE_CHECK_LANE


def ev(name: str, ts: float, dur: float, lane: int = DATA, **args) -> dict:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "tid": lane, "args": args}


def calls(ranks: int = 2, n: int = 5, t0: float = 1e9) -> list[list[dict]]:
    """``n`` checked allreduces of 1 ms on each rank, 2 ms apart."""
    return [[e for i in range(n) for e in (
        ev("NEGOTIATE_ALLREDUCE", t0 + 2000 * i, 200, CHECK, process_set_size=ranks),
        ev("ALLREDUCE", t0 + 2000 * i + 300, 1000, dtype="float32"))] for _ in range(ranks)]


def bars(svg: str) -> list[tuple[float, str]]:
    """(width, tooltip) of every event's bar."""
    return [(float(w), tip) for w, tip in
            re.findall(r'<rect x="[^"]+" y="[^"]+" width="([^"]+)" height="12" fill="[^"]+">'
                       r"<title>([^<]*)</title>", svg)]


def texts(svg: str) -> list[str]:
    return re.findall(r"<text[^>]*>([^<]*)</text>", svg)


def test_names_are_the_notebooks_not_horovods():
    assert shown_name("NEGOTIATE_ALLREDUCE") == "allreduce call check"
    assert shown_name("NEGOTIATE_OPTIMIZER_STEP") == "optimizer step call check"
    assert shown_name("ALLGATHER") == "allgather"
    shown = Timeline(calls(), path="trace.json")
    page = shown._repr_html_() + repr(shown)
    labels = texts(shown.svg())
    assert "rank 0 data" in labels and "rank 1 call check" in labels
    assert not any(label.endswith(" check") and "call" not in label for label in labels)
    assert {r.event for r in shown.summary()} == {"allreduce", "allreduce call check"}
    # Horovod's name appears once: where the Chrome trace is said to keep it
    assert page.count("NEGOTIATE") == 2 and "NEGOTIATE_ALLREDUCE" not in page
    assert "call checks keep Horovod&#x27;s name, NEGOTIATE_&lt;OP&gt;" in shown._repr_html_()


def test_the_chrome_trace_keeps_horovods_names_and_names_the_lanes():
    trace = protocol.chrome_trace(calls())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert names == {"ALLREDUCE", "NEGOTIATE_ALLREDUCE"}
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {"data", "call check"}


def test_calls_are_counted_per_rank_and_times_say_what_they_are_of():
    per_rank = calls(ranks=4, n=5)
    per_rank[3].append(ev("ALLREDUCE", 1e9 + 20_000, 7000))  # one rank made one more call
    rows = {r.event: r for r in Timeline(per_rank).summary()}
    check = rows["allreduce call check"]
    assert check.calls == (5, 5) and check.calls_text == "5"
    assert abs(check.ms_per_call - 0.2) < 1e-9 and abs(check.ms_per_rank - 1.0) < 1e-9
    data = rows["allreduce"]
    assert data.calls == (5, 6) and data.calls_text == "5-6"
    assert (data.longest_ms, data.longest_rank) == (7.0, 3)
    assert abs(data.ms_per_rank - (4 * 5 + 7) / 4) < 1e-9
    assert abs(data.ms_per_call - (4 * 5 + 7) / 21) < 1e-9
    assert list(rows) == ["allreduce", "allreduce call check"], "the most time first"
    text = repr(Timeline(per_rank))
    header = text.splitlines()[0].split("  ")
    assert [h.strip() for h in header if h.strip()] == [
        "event", "calls per rank", "ms per rank", "ms per call", "longest call ms"]
    assert re.search(r"^allreduce call check\s+5\s", text, re.MULTILINE), text
    assert "4 ranks. calls per rank: each rank's count" in text
    assert "<th>calls per rank</th>" in Timeline(per_rank)._repr_html_()


def test_legend_names_each_colour_drawn():
    per_rank = calls()
    per_rank[0].append(ev("BROADCAST", 1e9 + 11_000, 500))
    svg = Timeline(per_rank).svg()
    labels = texts(svg)
    start = labels.index("colours:")
    assert labels[start + 1:start + 4] == ["allreduce", "broadcast", "call check"]
    assert "allgather" not in labels, "only what is drawn"
    fills = dict(re.findall(r'fill="(#[0-9a-f]+)"/><text[^>]*>([^<]*)</text>', svg))
    drawn = set(re.findall(r'height="12" fill="(#[0-9a-f]+)"', svg))
    assert set(fills) == drawn, (fills, drawn)


def test_time_axis_has_round_ticks_and_a_label():
    svg = Timeline(calls(n=5)).svg()  # 0 to 9.3 ms
    labels = texts(svg)
    assert "time from the first event (ms)" in labels
    ticks = [float(t.replace(",", "")) for t in labels if re.fullmatch(r"[\d,.]+", t)]
    assert len(ticks) >= 4 and ticks[0] == 0
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1 and steps.pop() in (0.5, 1, 2, 2.5, 5), ticks
    for span, step in ((93_000, 10), (4.2e6, 500), (12e6, 2)):
        axis = Axis.fit([(0, span)], 125, 760)
        found, unit = axis.ticks()
        values = [float(label.replace(",", "")) for _, label in found]
        assert values[:2] == [0, step] and len(values) >= 4, (span, values, unit)


def test_one_long_wait_does_not_flatten_the_other_bars():
    per_rank = calls(ranks=2, n=5)
    end = 1e9 + 10_000
    per_rank[0].append(ev("NEGOTIATE_BROADCAST", end, 90e6, CHECK))  # waits 1.5 min...
    per_rank[1].append(ev("NEGOTIATE_BROADCAST", end + 90e6 - 100, 100, CHECK))  # ...for it
    for rank in per_rank:
        rank.append(ev("BROADCAST", end + 90e6 + 200, 1000))
    svg = Timeline(per_rank).svg()
    widths = {tip: w for w, tip in bars(svg)}
    ms_bars = [w for tip, w in widths.items() if tip.startswith("rank 0: allreduce,")]
    assert len(ms_bars) == 5 and min(ms_bars) > 40, ms_bars  # 1 ms of ~11 is still wide
    waited = next(w for tip, w in widths.items() if "broadcast call check, 1.5 min" in tip)
    assert waited < 100, "the long wait is cut short, its tooltip says how long it was"
    assert "+1.5 min" in texts(svg), "and the axis says how much was cut"
    assert "cut-short idle stretch" in texts(svg)


def test_regular_gaps_stay_to_scale():
    """The compute between training steps is time spent: no break hides it."""
    per_rank = [[ev("ALLREDUCE", 1e9 + 10_000 * i, 400) for i in range(50)] for _ in range(2)]
    svg = Timeline(per_rank).svg()
    assert "cut-short" not in svg
    axis = Axis.fit([(10_000 * i, 10_000 * i + 400) for i in range(50)], 0, 700)
    assert axis.breaks == [] and abs(axis.x(490_400) - 700) < 1e-6


def test_axis_is_linear_between_breaks_and_monotonic():
    axis = Axis.fit([(0, 1000), (2000, 3000), (10e6, 10e6 + 1000)], 100, 500)
    assert len(axis.breaks) == 1 and axis.breaks[0] == (3000, 10e6)
    xs = [axis.x(t) for t in (0, 1000, 2000, 3000, 5e6, 10e6, 10e6 + 1000)]
    assert xs == sorted(xs) and xs[0] == 100 and abs(xs[-1] - 600) < 1e-6
    assert abs((xs[1] - xs[0]) - (xs[-1] - xs[-2])) < 1e-6, "one scale on both sides"
    assert abs(xs[5] - xs[3] - axis.break_px) < 1e-6
