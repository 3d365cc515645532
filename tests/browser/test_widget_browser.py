"""The widget's front end in Chromium, on its own: the joined ES module (numbers.js, chart.js,
widget.js) rendered into a page with a stand-in for the widget model (get/set/on/send, the
part of anywidget's model a render function uses), so each behaviour is checked in a second
or two. test_browser.py runs the same module in JupyterLab against a real kernel.

What is checked: the JavaScript formatter on the table of cases numbers.py is tested on; train
and validation on one chart, markers on sparse series, no smoothing on few points; what each
number is (header: last values; legends: last, smoothed, min/max, in one format); axis names
and a final tick at the last step; the ETA; the hover read-out; zoom by dragging and back by
double-click; the log toggle and smoothing saved in the model's settings (the saved widget
state); per-rank curves; PNG and CSV export; controls in JupyterLab's colours; the chart plan
in the ``charts`` trait, and in ``layout`` as notebooks saved before the rename have it. Every
test fails on an error in the page.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import CHROMIUM, CHROMIUM_ARGS

from ipydist.notebook.live.layout import chart_layout
from ipydist.notebook.live.widget import FRONT_END, front_end_source

LIVE = Path(__file__).resolve().parents[2] / "src" / "ipydist" / "notebook" / "live"
CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "numbers.json").read_text())

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (make test does)",
)

#: A stand-in for the anywidget model, and the module rendered into #host with it.
MOUNT = """async ([src, state]) => {
  class Model {
    constructor(s) { this.s = s; this.h = {}; this.sent = []; this.saves = 0; }
    get(k) { return this.s[k]; }
    set(k, v) { this.s[k] = v; (this.h['change:' + k] || []).forEach((f) => f()); }
    save_changes() { this.saves++; }
    on(e, f) { (this.h[e] ??= []).push(f); }
    off(e, f) { this.h[e] = (this.h[e] || []).filter((g) => g !== f); }
    send(m) { this.sent.push(m); }
    emit(e, m) { (this.h[e] || []).forEach((f) => f(m)); }
  }
  const url = URL.createObjectURL(new Blob([src], {type: 'text/javascript'}));
  const mod = await import(url);
  window.model = new Model(state);
  mod.default.render({model: window.model, el: document.getElementById('host')});
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
}"""


def _state(n=300, **extra) -> dict:
    steps = list(range(n))
    series = {
        "loss": [steps, [2 / (s + 1) + 0.05 * math.sin(s) for s in steps],
                 [s * 0.05 for s in steps]],
        "val_loss": [steps[49::50], [0.3, 0.2, 0.15, 0.12, 0.1, 0.09][: len(steps[49::50])],
                     [s * 0.05 for s in steps[49::50]]],
        "val_acc": [steps[49::50], [0.8, 0.9, 0.95, 0.96, 0.97, 0.976][: len(steps[49::50])],
                    [s * 0.05 for s in steps[49::50]]],
        "epoch": [steps, [s // 50 for s in steps], [s * 0.05 for s in steps]],
    }
    state = {"key": "k1", "series": series, "rank_series": {}, "settings": {}, "done": True,
             "charts": chart_layout(list(series)),
             "stats": {"points": n, "latest": {"loss": 0.01}, "steps_per_s": 190_000,
                       "progress": 1.0, "step": n - 1, "total": n, "eta": 0, "elapsed": 15,
                       "ranks": []}}
    state.update(extra)
    return state


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    pg = browser.new_page(viewport={"width": 1000, "height": 1000}, accept_downloads=True)
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    css = (LIVE / "widget.css").read_text()
    pg.set_content(f"<html><head><style>{css}</style></head>"
                   "<body><div id=host style='width:900px'></div></body></html>")
    yield pg
    pg.close()
    assert not errors, f"errors in the page: {errors}"


def mount(page, state):
    page.evaluate(MOUNT, [front_end_source(), state])
    return page.locator(".ipydist-metrics")


def test_javascript_formats_numbers_as_python_does(page):
    source = "\n".join((LIVE / name).read_text() for name in FRONT_END[:1])
    page.add_script_tag(content=source)
    got = page.evaluate(
        """(cases) => cases.map((c) => {
            const v = typeof c.in === 'string' ? Number(c.in) : c.in;
            return {number, count, tick_labels: tickLabels, duration}[c.fn](v);
        })""", CASES)
    wrong = [(c["fn"], c["in"], g, c["out"]) for c, g in zip(CASES, got) if g != c["out"]]
    assert not wrong, f"(function, input, JavaScript's, the table's): {wrong}"


def test_train_and_validation_share_a_chart_with_markers_and_no_smoothing_on_few_points(page):
    root = mount(page, _state())
    charts = root.locator("svg.ipydist-chart")
    assert charts.evaluate_all("cs => cs.map(c => c.dataset.chart)") == ["loss", "acc"]
    assert charts.evaluate_all("cs => cs.map(c => c.dataset.series)") == [
        "loss,val_loss", "val_acc"], "epoch is drawn as lines, not as a chart"
    loss = charts.nth(0)
    assert loss.locator("path.ipydist-raw[data-series=loss]").count() == 1, "loss is smoothed"
    assert loss.locator("path.ipydist-raw[data-series=val_loss]").count() == 0, (
        "six points: never smoothed, the line is the values themselves")
    assert loss.locator("circle.ipydist-marker").count() == 6, "markers on val_loss's points"
    assert loss.locator("line.ipydist-epoch").count() == 5, "a line where each epoch began"
    assert loss.locator(".ipydist-best title").nth(1).text_content() == (
        "min of val_loss: 0.09 at step 299")
    ticks = loss.locator("text.ipydist-tick:not(.ipydist-legend)").all_text_contents()
    assert "50" in ticks and not any(t.endswith(".0") or t.endswith("0.500") for t in ticks)
    header = root.locator(".ipydist-header").text_content()
    assert header.startswith("last: loss 0.01"), header
    assert "190 k steps/s" in header and "done in 0:15" in header and "points" not in header
    assert root.locator(".ipydist-progress-text").text_content().startswith("300 of 300 steps")
    gap = page.evaluate("""() => {
        const bar = document.querySelector('.ipydist-bar').getBoundingClientRect();
        const text = document.querySelector('.ipydist-progress-text').getBoundingClientRect();
        return text.left - bar.right; }""")
    assert gap >= 6, "the progress text is not glued to the bar"


def test_hover_shows_every_curves_value_at_that_step(page):
    root = mount(page, _state())
    box = root.locator("svg.ipydist-chart").nth(0).bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 80)
    tip = root.locator(".ipydist-hover")
    assert tip.is_visible()
    text = tip.text_content()
    assert text.startswith("step 1"), text
    assert "loss" in text and "smoothed" in text and "val_acc" in text
    assert root.locator(".ipydist-crosshair[visibility=visible]").count() == 2, (
        "the crosshair is on every chart at once")
    page.mouse.move(box["x"] + 10, box["y"] + box["height"] + 400)
    assert not tip.is_visible()


def test_drag_zooms_every_chart_and_double_click_zooms_out(page):
    root = mount(page, _state())
    box = root.locator("svg.ipydist-chart").nth(0).bounding_box()
    y = box["y"] + 80
    page.mouse.move(box["x"] + 100, y)
    page.mouse.down()
    page.mouse.move(box["x"] + 300, y, steps=5)
    page.mouse.up()
    page.wait_for_function("() => document.querySelector('.ipydist-metrics').dataset.zoom")
    lo, hi = map(float, root.get_attribute("data-zoom").split(","))
    assert 0 < lo < hi < 299
    assert root.locator(".ipydist-reset-zoom").is_visible()
    page.mouse.wheel(0, 100)  # the wheel pans a zoomed chart
    page.wait_for_function(
        "(lo) => Number(document.querySelector('.ipydist-metrics').dataset.zoom.split(',')[0])"
        " > lo", arg=lo)
    page.mouse.dblclick(box["x"] + 200, y)
    page.wait_for_function("() => !document.querySelector('.ipydist-metrics').dataset.zoom")


def test_settings_are_saved_in_the_model_and_read_back(page):
    root = mount(page, _state())
    root.locator("svg.ipydist-chart[data-chart=loss] ~ .ipydist-chart-toggles input").check()
    root.locator(".ipydist-smoothing").fill("0.9")
    root.locator(".ipydist-x-axis").select_option("time")
    settings = page.evaluate("() => [window.model.get('settings'), window.model.saves]")
    assert settings[0] == {"smoothing": 0.9, "log": {"loss": True}, "ranks": {}, "x": "time"}
    assert settings[1] == 3, "each change saved at once"
    page.wait_for_timeout(100)
    assert "0:" in "".join(root.locator("svg[data-chart=loss] text.ipydist-tick")
                           .all_text_contents()), "the x axis reads as a clock"
    # A notebook reopened with these settings in its widget state shows them again.
    page.set_content(page.content().replace(root.inner_html(), ""))
    again = mount(page, _state(settings=settings[0]))
    assert again.locator(".ipydist-smoothing").input_value() == "0.9"
    assert again.locator("svg[data-chart=loss] ~ .ipydist-chart-toggles input").is_checked()


def test_per_rank_curves_for_metrics_logged_with_reduce_none(page):
    state = _state()
    steps = state["series"]["loss"][0]
    state["rank_series"] = {"loss": {str(r): [steps, [r + 1 / (s + 1) for s in steps], steps]
                                     for r in (1, 2, 3)}}
    root = mount(page, state)
    toggle = root.locator("svg[data-chart=loss] ~ .ipydist-chart-toggles .ipydist-toggle-ranks")
    toggle.check()
    page.wait_for_timeout(100)
    series = root.locator("svg[data-chart=loss]").get_attribute("data-series")
    assert series.split(",")[:4] == [f"loss · rank {r}" for r in range(4)]
    assert page.evaluate("() => window.model.get('settings').ranks") == {"loss": True}


def test_live_points_append_and_redraw(page):
    state = _state(n=0, done=False, series={}, charts=chart_layout([]), stats={"points": 0})
    root = mount(page, state)
    page.evaluate("""(plan) => {
        window.model.set('charts', plan);
        window.model.emit('msg:custom', {type: 'append', count: 3,
            series: {loss: [[0, 1, 2], [1, 0.5, 0.25], [0, 0.1, 0.2]]}, rank_series: {}});
    }""", chart_layout(["loss"]))
    page.wait_for_function("() => document.querySelector('.ipydist-metrics').dataset.points"
                           " === '3'")
    assert root.locator("svg[data-chart=loss] circle.ipydist-marker").count() == 3


def test_a_page_that_opens_mid_cell_asks_for_the_points_and_skips_those_it_has(page):
    """The widget of a page that opened while the cell runs has the state (stats, the plan)
    but none of the points sent before: it asks for them ("points"), draws them, and of an
    append that crosses the reply keeps only the steps past the last it has."""
    state = _state(n=0, done=False, series={}, charts=chart_layout(["loss"]),
                   stats={"points": 5, "step": 4})
    root = mount(page, state)
    assert page.evaluate("() => window.model.sent") == [{"type": "points"}]
    page.evaluate("""() => {
        window.model.emit('msg:custom', {type: 'points', count: 5,
            series: {loss: [[0, 1, 2, 3, 4], [5, 4, 3, 2, 1], [0, 1, 2, 3, 4]]}, rank_series: {}});
        window.model.emit('msg:custom', {type: 'append', start: 3, count: 5,
            series: {loss: [[3, 4], [2, 1], [3, 4]]}, rank_series: {}});
        window.model.emit('msg:custom', {type: 'append', start: 3, count: 7,
            series: {loss: [[3, 4, 5, 6], [2, 1, 0.5, 0.25], [3, 4, 5, 6]]}, rank_series: {}});
    }""")
    page.wait_for_function("() => document.querySelector('.ipydist-metrics').dataset.points"
                           " === '7'")
    assert root.locator("svg[data-chart=loss] circle.ipydist-marker").count() == 7


def test_the_page_that_saw_the_cell_start_asks_for_nothing(page):
    mount(page, _state(n=0, done=False, series={}, charts=chart_layout([]),
                       stats={"points": 0}))
    assert page.evaluate("() => window.model.sent") == []
    mount(page, _state())  # a finished cell: its final curves are in the state
    assert page.evaluate("() => window.model.sent") == []


def test_png_and_csv_export(page, tmp_path):
    root = mount(page, _state())
    with page.expect_download() as png:
        root.locator(".ipydist-export-png").click()
    path = tmp_path / "metrics.png"
    png.value.save_as(path)
    assert png.value.suggested_filename == "metrics.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    # No kernel answers here (as in a reopened notebook): the curves in the widget are saved.
    with page.expect_download(timeout=10_000) as csv:
        root.locator(".ipydist-export-csv").click()
    assert page.evaluate("() => window.model.sent") == [{"type": "csv"}]
    csv.value.save_as(tmp_path / "metrics.csv")
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,seconds,loss,val_loss,val_acc,epoch" and len(lines) == 301


def _legends(root):
    return root.locator("text.ipydist-legend").all_text_contents()


def test_legends_say_what_each_number_is_in_one_format(page):
    root = mount(page, _state())
    legends = _legends(root)
    assert re.fullmatch(r"loss: last -?[\d.]+ · smoothed -?[\d.]+ · min -?[\d.]+", legends[0]), (
        legends)
    assert legends[1:] == ["val_loss: last 0.09 · min 0.09", "val_acc: last 0.976 · max 0.976"]
    # The static copy words the same series, and the header's numbers, the same way.
    from ipydist.notebook.live.static import fallback_bundle, summary_line

    state = _state()
    series = {n: s[:2] for n, s in state["series"].items()}
    html = fallback_bundle("k", series, state["stats"], state["charts"])["text/html"]
    assert all(legend in html for legend in legends), (legends, html[:2000])
    summary = root.locator(".ipydist-header").get_attribute("data-summary")
    assert summary == summary_line(state["stats"]) == (
        "last: loss 0.01 · 300 of 300 steps · 190 k steps/s · done in 0:15")
    # No legend runs into the toggles over the chart's top right.
    overlap = page.evaluate("""() => [...document.querySelectorAll('.ipydist-chart-box')]
        .some((box) => {
            const t = box.querySelector('.ipydist-chart-toggles').getBoundingClientRect();
            return [...box.querySelectorAll('text.ipydist-legend')].some((l) => {
                const r = l.getBoundingClientRect();
                return r.right > t.left && r.left < t.right && r.bottom > t.top && r.top < t.bottom;
            }); })""")
    assert not overlap


def test_a_long_legend_wraps_and_the_chart_grows(page):
    names = [f"loss_{k}_with_a_rather_long_name" for k in range(6)]
    steps = list(range(100))
    series = {n: [steps, [1 / (s + 1) for s in steps], steps] for n in names}
    plan = {**chart_layout([]), "charts": [{"title": "loss", "series": [
        {"name": n, "color": "#000", "best": "min"} for n in names]}]}
    root = mount(page, _state(series=series, charts=plan))
    svg = root.locator("svg.ipydist-chart")
    assert int(svg.get_attribute("height")) > 172
    rows = {round(float(y)) for y in svg.locator("text.ipydist-legend").evaluate_all(
        "ls => ls.map(l => l.getAttribute('y'))")}
    assert len(rows) >= 2, "the legend takes a second line"


def test_axes_are_named_and_end_with_a_tick_at_the_last_step(page):
    root = mount(page, _state())
    loss = root.locator("svg[data-chart=loss]")
    assert loss.locator(".ipydist-axis-label").text_content() == "step"
    ticks = loss.locator("text.ipydist-tick:not(.ipydist-legend):not(.ipydist-axis-label)")
    assert ticks.all_text_contents()[-1] == "299", "a final tick at the last step"
    root.locator(".ipydist-x-axis").select_option("time")
    page.wait_for_timeout(100)
    assert loss.locator(".ipydist-axis-label").text_content() == (
        "time since the first point (m:ss)")
    assert ticks.all_text_contents()[-1] == "0:15", "the last point's time (299 x 0.05 s)"
    root.locator("svg[data-chart=loss] ~ .ipydist-chart-toggles input").check()
    page.wait_for_timeout(100)
    assert loss.locator(".ipydist-chart-title").text_content() == "loss (log scale)"
    assert _legends(root)[1] == "val_loss: last 0.09 · min 0.09", "values, not their logs"


def _progress(page, state) -> str:
    mount(page, state)
    return page.locator(".ipydist-progress-text").text_content()


@pytest.mark.parametrize("eta, shown", [
    (None, "150 of 300 steps · 50%"), (95.4, "150 of 300 steps · 50% · ETA 1:35"),
    (0.3, "150 of 300 steps · 50% · ETA <0:01")])
def test_eta_is_a_real_estimate_or_hidden(page, eta, shown):
    stats = {**_state()["stats"], "step": 149, "progress": 0.5, "eta": eta}
    assert _progress(page, _state(done=False, stats=stats)) == shown


def test_no_eta_once_the_cell_ended_and_no_progress_bar_without_a_total(page):
    assert "ETA" not in _progress(page, _state())
    page.set_content("<div id=host style='width:900px'></div>")
    stats = {**_state()["stats"], "total": None, "progress": None, "eta": None}
    root = mount(page, _state(stats=stats))
    assert not root.locator(".ipydist-progress").is_visible()
    assert "step 299" in root.locator(".ipydist-rates").text_content(), "how far, without a total"


def test_controls_follow_jupyterlab_colours_and_the_rank_bar_explains_itself(page):
    stats = {**_state()["stats"], "ranks": [
        {"rank": 0, "step_s": 0.05, "compute_s": 0.02, "max_s": 0.06, "straggler": False},
        {"rank": 1, "step_s": 0.05, "compute_s": 0.045, "max_s": 0.07, "straggler": True}]}
    root = mount(page, _state(stats=stats))
    style = """(e) => { const s = getComputedStyle(e);
        return [s.backgroundColor, s.borderTopColor, s.color, s.fontSize]; }"""
    plain = root.locator(".ipydist-export-png").evaluate(style)
    assert plain[:2] == ["rgb(255, 255, 255)", "rgb(189, 189, 189)"], "JupyterLab's light theme"
    assert root.locator(".ipydist-x-axis").evaluate(style) == plain, "menu and buttons alike"
    page.evaluate("""() => { const h = document.getElementById('host').style;
        h.setProperty('--jp-layout-color1', 'rgb(17, 17, 17)');
        h.setProperty('--jp-border-color1', 'rgb(80, 80, 80)');
        h.setProperty('--jp-ui-font-color1', 'rgb(230, 230, 230)');
        h.setProperty('--jp-ui-font-size1', '11px'); }""")
    assert root.locator(".ipydist-export-csv").evaluate(style) == [
        "rgb(17, 17, 17)", "rgb(80, 80, 80)", "rgb(230, 230, 230)", "11px"], "a dark theme"
    title = root.locator(".ipydist-ranks-title")
    assert "full bar = 50 ms" in title.text_content()
    assert "outside ipydist's collectives" in title.get_attribute("title")
    assert "outside collectives 45 ms" in root.locator(
        ".ipydist-rank[data-rank='1'] .ipydist-rank-track").get_attribute("title")


def test_a_notebook_saved_with_the_plan_in_layout_still_draws(page):
    """Widget state saved before the trait was renamed has the plan in ``layout``; a state
    whose ``layout`` is something else (ipywidgets' Layout model) draws nothing from it."""
    state = _state()
    state["layout"] = state.pop("charts")
    root = mount(page, state)
    assert root.locator("svg.ipydist-chart").evaluate_all(
        "cs => cs.map(c => c.dataset.chart)") == ["loss", "acc"]
    page.set_content("<div id=host style='width:900px'></div>")
    state = _state()
    state.pop("charts")
    state["layout"] = {"width": "100%", "_model_name": "LayoutModel"}
    root = mount(page, state)
    assert root.locator("svg.ipydist-chart").count() == 0
    assert root.get_attribute("data-points") == "300"
