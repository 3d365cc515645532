"""The live metrics widget in a real browser, and a newcomer's first notebook.

JupyterLab runs the quickstart notebook in Chromium (Debian's package, driven by Playwright) and
the test watches the chart under the training cell fill up while that cell is still running:
this is the one place where the widget's JavaScript, the kernel's comm messages and the ranks'
``hvd.log`` stream are all real at once. That JupyterLab is a newcomer's: ipydist's wheel, built
from this checkout as ``make wheel`` builds it, installed into a new environment
(tests/harness/newcomer.py), whose ``jupyter labextension list`` names the side panel, whose
page shows the panel, and whose kernel and ranks import ipydist from the wheel.

Needs ``/usr/bin/chromium``: ``scripts/ensure-chromium.sh`` installs it (``make test`` runs it
first). Playwright never downloads a browser of its own here.

What the widget promises (its contract with this test): under a running cell that calls
``hvd.log``, an element ``.ipydist-metrics`` with ``data-points`` (points received so far) and
``data-done`` (``"false"`` while the cell runs, ``"true"`` once it ended), and an SVG chart.

Any uncaught exception or console error in the page fails a test (``lab_server.browser_page``)
unless the test says it expects it, and why.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import newcomer
import psutil
import pytest
from helpers import CHROMIUM, kept_forkservers, wait_gone
from lab_server import (
    ARTIFACTS,
    NOTEBOOK7_OWN_ERRORS,
    REPO,
    WIDGET_STATE_NOT_SAVED,
    Lab,
    browser_page,
    end_sessions,
    open_notebook,
    ran,
    run_all_cells,
    running,
    serve,
)

QUICKSTART = REPO / "notebooks" / "01-quickstart.ipynb"
#: The quickstart's widget alone; ``IPYDIST_UPDATE_SCREENSHOT=1`` copies it to the README's.
WIDGET_SCREENSHOT = ARTIFACTS / "live-metrics.png"
README_SCREENSHOT = REPO / "docs" / "live-metrics.png"
#: The quickstart's training cell logs one point per step (20 epochs x 10 steps) and one per
#: epoch (the test accuracy), from rank 0.
EXPECTED_POINTS = 220
MIN_ACCURACY = 0.9

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (make test does)",
)


@pytest.fixture
def newcomer_lab(tmp_path):
    """JupyterLab from a new environment with ipydist's wheel installed, serving the
    quickstart: the README's path for a person who installs the wheel."""
    wheel = newcomer.build_wheel(tmp_path)
    panel = newcomer.panel_files(wheel)
    assert any(n.endswith("/ipydist/package.json") for n in panel), (
        f"the wheel has no side panel (make test builds it first: make .venv/.labextension): "
        f"{zipfile.ZipFile(wheel).namelist()[-20:]}")
    assert any("/static/remoteEntry." in n for n in panel), "the panel comes prebuilt"
    new = newcomer.install(tmp_path, wheel)
    assert (new.labextensions / "ipydist" / "package.json").is_file()
    # (the test venv's script, run by the new environment's Python, as its own would be)
    listed = new.run([str(Path(sys.executable).parent / "jupyter-labextension"), "list"])
    text = listed.stdout + listed.stderr
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("ipydist ")), "")
    assert "enabled" in line and "OK" in line and str(new.labextensions) in text, text
    with serve(tmp_path, {QUICKSTART.name: QUICKSTART}, python=new.python) as server:
        yield server


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of the quickstart and the restarts notebook."""
    with serve(tmp_path, {QUICKSTART.name: QUICKSTART,
                          RESTARTS: _restarts_notebook()}) as server:
        yield server


@pytest.fixture
def console() -> list[str]:
    """The browser's console messages and page errors, in order."""
    return []


@pytest.fixture
def allowed() -> list[re.Pattern]:
    """Console errors a test expects (none unless it adds them, with the reason)."""
    return []


@pytest.fixture
def page(request, console, allowed):
    """A Chromium page; a page or console error the test did not expect fails it."""
    with browser_page(console, f"browser-{request.node.name}", allowed) as pg:
        yield pg


#: One reading of the notebook as the browser shows it: every code cell's prompt, and the
#: training cell's prompt, output text and widget attributes.
READ_NOTEBOOK = """(index) => {
    const cells = [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')];
    const prompt = (c) => (c.querySelector('.jp-InputPrompt')?.textContent ?? '').trim();
    const cell = cells[index];
    const widget = cell?.querySelector('.ipydist-metrics');
    return {
        ncells: cells.length,
        prompts: cells.filter((c) => c.classList.contains('jp-CodeCell')).map(prompt),
        outputs: cells.filter((c) => c.classList.contains('jp-CodeCell')).map(
            (c) => c.querySelector('.jp-OutputArea')?.textContent ?? ''),
        prompt: cell ? prompt(cell) : '',
        output: cell?.querySelector('.jp-OutputArea')?.textContent ?? '',
        points: widget ? widget.getAttribute('data-points') : null,
        done: widget ? widget.getAttribute('data-done') : null,
        marks: widget ? widget.querySelectorAll('svg path, svg polyline').length : 0,
    };
}"""

#: Records, in the page, every value the training cell's widget shows, with the cell's prompt at
#: that moment: a MutationObserver sees each change the kernel's messages make, where polling
#: from the test (a round trip per reading, slow on a loaded machine) saw one value while a
#: short training cell ran (CI, issue 46).
RECORD_WIDGET = """(index) => {
    window.__ipydistShown = [];
    const note = (widget) => {
        const cell = widget.closest('.jp-Cell');
        const cells = [...document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')];
        if (cells.indexOf(cell) !== index) return;
        window.__ipydistShown.push({
            points: widget.getAttribute('data-points'),
            done: widget.getAttribute('data-done'),
            prompt: (cell.querySelector('.jp-InputPrompt')?.textContent ?? '').trim(),
        });
    };
    new MutationObserver((changes) => {
        for (const change of changes) {
            const widgets = change.type === 'attributes'
                ? [change.target]
                : [...change.addedNodes].flatMap((n) => n.querySelectorAll
                    ? [...(n.matches?.('.ipydist-metrics') ? [n] : []),
                       ...n.querySelectorAll('.ipydist-metrics')] : []);
            widgets.filter((w) => w.classList?.contains('ipydist-metrics')).forEach(note);
        }
    }).observe(document.body, {subtree: true, childList: true, attributes: true,
                               attributeFilter: ['data-points', 'data-done']});
}"""

#: Brings the training cell's chart (or its output) into view, for the screenshot.
SCROLL_TO_CELL = """(index) => {
    const cell = document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-Cell')[index];
    cell?.querySelector('.ipydist-metrics, .jp-OutputArea')?.scrollIntoView({block: 'center'});
}"""


def _training_cell_index() -> int:
    """Index (among all cells) of the quickstart's cell that calls ``hvd.log`` every step."""
    cells = json.loads(QUICKSTART.read_text())["cells"]
    found = [i for i, c in enumerate(cells)
             if c["cell_type"] == "code" and "hvd.log(" in "".join(c["source"])]
    assert len(found) == 1, f"expected one training cell calling hvd.log, found {found}"
    return found[0]


def _watch_run(page, lab: Lab, index: int, timeout: float = 200.0):
    """Poll the page until no cell is queued or running any more.

    Returns every reading taken while the training cell had its widget (in order), the last
    reading, and every process the server had started during the run. Polls often: on a fast
    machine the training cell may run for a second or two only.
    """
    readings, seen = [], {}
    deadline = time.monotonic() + timeout
    next_scan = 0.0
    while time.monotonic() < deadline:
        now = page.evaluate(READ_NOTEBOOK, index)
        if now["points"] is not None:
            if not readings:  # the chart in view, for the screenshot
                page.evaluate(SCROLL_TO_CELL, index)
            readings.append(now)
        if time.monotonic() >= next_scan:
            seen.update(lab.processes(marked=False))  # the cluster runs under the kernel
            next_scan = time.monotonic() + 0.5
        if not any(running(p) for p in now["prompts"]):
            return readings, now, seen
        time.sleep(0.05)
    pytest.fail(f"the notebook was still running after {timeout:.0f} s; prompts: {now['prompts']}"
                f"\ntraining cell output:\n{now['output'][-2000:]}\n{lab.log_tail()}")


def _settled(page, index: int, timeout: float = 10.0) -> dict:
    """The training cell's final reading, once its widget says done and has every point (the
    last batch may land a moment after the cell's reply), or the last reading at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        now = page.evaluate(READ_NOTEBOOK, index)
        finished = now["done"] == "true" and now["points"] == str(EXPECTED_POINTS)
        if finished or time.monotonic() >= deadline:
            return now
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------- test


@pytest.mark.timeout(300)
def test_quickstart_live_chart_in_a_newcomers_jupyterlab(newcomer_lab, page, console):
    lab = newcomer_lab
    index = _training_cell_index()
    open_notebook(page, lab, QUICKSTART.name, console)
    # the wheel's side panel is there, before any ipydist runs
    page.locator(".jp-SideBar.jp-mod-right .lm-TabBar-tab", has_text="ipydist").click()
    page.wait_for_function(
        "() => document.querySelector('#ipydist-cluster-panel .ipydist-cluster-caption')"
        "?.textContent.includes('no ipydist in this notebook')", timeout=30_000)
    before = lab.processes(marked=False)  # the kernel; everything new from here on is the cluster
    assert before, "the notebook's kernel says idle but JupyterLab has no child process"
    page.evaluate(RECORD_WIDGET, index)
    run_all_cells(page)
    readings, end, seen = _watch_run(page, lab, index)
    shown = page.evaluate("() => window.__ipydistShown")

    # The notebook itself: every cell ran (a failing cell stops Run All), training converged.
    assert end["ncells"] == len(json.loads(QUICKSTART.read_text())["cells"]), end
    stopped = [out for p, out in zip(end["prompts"], end["outputs"]) if ran(p)][-1:]
    assert all(ran(p) for p in end["prompts"]), (  # the last cell that ran says why
        f"not every cell ran: {end['prompts']}\nthe last that ran printed: {stopped}\n"
        f"{console[-20:]}\n{lab.log_tail()}")
    match = re.search(r"final test accuracy:\s*(\d+(?:\.\d+)?)", end["output"])
    assert match, f"no 'final test accuracy' in the training cell:\n{end['output'][-2000:]}"
    assert float(match.group(1)) >= MIN_ACCURACY, match.group(0)

    # %dist_stop, the last cell, ended the cluster: mpiexec, engines, controller. The kernel
    # keeps its fork server for its next start (it ends with the kernel), with no rank left.
    cluster = {pid: cmd for pid, cmd in seen.items() if pid not in before}
    assert cluster, "no cluster process was seen while the notebook ran"
    python = lab.proc.args[0]  # the newcomer's environment ran the ranks too
    assert any(cmd.startswith(python) for cmd in cluster.values()), (python, cluster)
    kept = kept_forkservers(cluster)
    left = wait_gone([p for p in cluster if p not in kept], timeout=10)
    assert not left, f"%dist_stop left these running: {[cluster[p] for p in left]}"
    assert not [c for p in kept for c in psutil.Process(p).children()], "a kept server has ranks"

    # The widget: it filled while the cell ran, and ended complete, marked done, with a chart.
    # "While it ran" is both the prompt's [*] and data-done "false": the widget may learn that
    # the cell ended a moment before the prompt does, and that is no fault.
    page.evaluate(SCROLL_TO_CELL, index)
    messages = "\n".join(console[-20:])
    bad = [r["points"] for r in readings if not re.fullmatch(r"\d+", r["points"])]
    assert not bad, f"data-points is not a whole number: {bad[:5]}"
    points = [int(r["points"]) for r in readings]
    assert points == sorted(points), f"data-points went down: {points}"
    done = [r["done"] for r in readings]
    assert set(done) <= {"false", "true"}, f"data-done is not 'false' or 'true': {set(done)}"
    assert done == sorted(done), f"data-done went from 'true' back to 'false': {done}"
    live = [int(r["points"]) for r in shown if running(r["prompt"]) and r["done"] == "false"]
    assert len(set(live)) >= 2, (
        "data-points of .ipydist-metrics did not rise while the training cell ran; values shown "
        f"while it ran: {live[:50]}; all shown: {shown[:50]}; after: points={end['points']} "
        f"done={end['done']}\n{messages}")
    final = _settled(page, index)
    assert final["done"] == "true", f"data-done is {final['done']!r} after the cell ended"
    assert final["points"] == str(EXPECTED_POINTS), (
        f"data-points is {final['points']!r} after the cell ended, expected {EXPECTED_POINTS}")
    assert final["marks"] >= 1, "no <svg> with a <path> or <polyline> in .ipydist-metrics"

    # Hovering the chart reads out the values at that step, on every chart at once.
    widget = page.locator(".ipydist-metrics").first
    chart = widget.locator("svg.ipydist-chart").first.bounding_box()
    page.mouse.move(chart["x"] + chart["width"] * 0.6, chart["y"] + chart["height"] / 2)
    tip = widget.locator(".ipydist-hover")
    tip.wait_for(state="visible", timeout=5_000)
    text = tip.text_content()
    assert re.match(r"step \d", text) and "loss" in text and "val_acc" in text, text
    assert widget.locator(".ipydist-crosshair[visibility=visible]").count() == 2
    widget.screenshot(path=str(WIDGET_SCREENSHOT))
    if os.environ.get("IPYDIST_UPDATE_SCREENSHOT"):  # the README's picture of the widget
        shutil.copy(WIDGET_SCREENSHOT, README_SCREENSHOT)


# ------------------------------------------------------------ restarts, reopening the notebook

RESTARTS = "restarts.ipynb"
#: Each logging cell: 40 points of loss and accuracy, validation every 10 steps.
LOGGING_CELL = """%%everyrank
import time
import ipydist.torch as hvd
for i in range(40):
    extra = {"val_loss": 1.2 / (i + 2)} if i % 10 == 9 else {}
    hvd.log(step=i, total=40, loss=1.0 / (i + 1), acc=i / 40, **extra)
    time.sleep(0.01)"""


def _restarts_notebook():
    """A notebook that logs, restarts the cluster, logs, restarts again, logs, and counts."""
    cells = ["%load_ext ipydist\n%dist_start --np 2", LOGGING_CELL, "%dist_restart",
             LOGGING_CELL, "%dist_restart", LOGGING_CELL,
             "import ipydist\nframe = ipydist.metrics()\n"
             "print('rows', len(frame), 'clusters', sorted(set(frame.cluster)))",
             "%dist_stop"]
    kernel = json.loads(QUICKSTART.read_text())["metadata"]["kernelspec"]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells],
                                    metadata={"kernelspec": kernel})


#: What the page shows of every metrics output: widgets, static copies, error boxes.
READ_OUTPUTS = r"""() => {
    const shown = (e) => e.offsetParent !== null && e.getClientRects().length > 0;
    const widgets = [...document.querySelectorAll('.ipydist-metrics')];
    const fallbacks = [...document.querySelectorAll('.ipydist-fallback')]
        .filter((e) => e.querySelector('svg'));
    const errors = [...document.querySelectorAll('.jp-OutputArea-output')]
        .filter((e) => /Error displaying widget|model not found/.test(e.textContent) && shown(e));
    return {
        widgets: widgets.map((w) => ({points: w.dataset.points, done: w.dataset.done,
            charts: [...w.querySelectorAll('svg.ipydist-chart')].map((c) => c.dataset.series),
            log: [...w.querySelectorAll('.ipydist-toggle-log')].map((b) => b.checked)})),
        fallbacks_shown: fallbacks.filter(shown).length,
        fallback_charts: fallbacks.filter(shown).map((f) => f.querySelectorAll('svg').length),
        errors: errors.map((e) => e.textContent.slice(0, 80)),
        // where an error box shows: the tags and classes around it, for the failure message
        error_dom: errors.slice(0, 1).map((e) => e.closest('.jp-OutputArea').outerHTML
            .replace(/<svg[\s\S]*?<\/svg>/g, '<svg/>').replace(/<style>[\s\S]*?<\/style>/g, '')
            .slice(0, 3000)),
        text: document.querySelector('.jp-Notebook')?.textContent ?? '',
    };
}"""


def _wait_idle_and_done(page, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        prompts = page.evaluate(
            "() => [...document.querySelectorAll('.jp-NotebookPanel .jp-InputPrompt')]"
            ".map((p) => p.textContent.trim())")
        if prompts and all(ran(p) for p in prompts):
            return
        time.sleep(0.25)
    pytest.fail(f"the notebook did not finish within {timeout:.0f} s: {prompts}")


def _save(page) -> None:
    page.locator(".jp-NotebookPanel").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-NotebookPanel .jp-mod-dirty')"
                           " && !document.title.startsWith('*')")
    time.sleep(0.5)


#: True once each widget output above a static copy has rendered its widget, or the widget
#: manager has given up on it ("model not found", hidden or not): only then can a test tell
#: whether an error box shows.
WIDGETS_SETTLED = """(count) => {
    const outs = [...document.querySelectorAll('.jp-OutputArea-child')]
        .filter((c) => c.nextElementSibling?.querySelector('.ipydist-fallback'));
    return outs.length === count && outs.every((c) => c.querySelector('.ipydist-metrics')
        || /Error displaying widget/.test(c.textContent));
}"""


def _reopen(page, lab: Lab, path: str = f"/lab/tree/{RESTARTS}", widgets: int = 3) -> dict:
    """Open the notebook anew with no kernel state behind it (every kernel shut down first,
    as after closing JupyterLab); what it shows once every widget output has settled."""
    end_sessions(lab)
    page.goto(lab.url(path))
    page.wait_for_selector(".jp-Notebook .jp-Cell .ipydist-fallback")
    page.wait_for_function(WIDGETS_SETTLED, arg=widgets, timeout=60_000)
    return page.evaluate(READ_OUTPUTS)


@pytest.mark.timeout(420)
def test_points_survive_restarts_and_a_reopened_notebook_shows_its_charts(lab, page, console,
                                                                          allowed):
    open_notebook(page, lab, RESTARTS, console)
    run_all_cells(page)
    _wait_idle_and_done(page)
    time.sleep(1)
    now = page.evaluate(READ_OUTPUTS)
    assert "rows 120 clusters [1, 2, 3]" in now["text"], now["text"][-1500:]
    assert [w["points"] for w in now["widgets"]] == ["40", "40", "40"], (
        f"every cell's chart has its 40 points, whichever cluster logged them: {now}")
    assert all(w["charts"] == ["loss,val_loss", "acc"] for w in now["widgets"]), now["widgets"]
    assert now["fallbacks_shown"] == 0, "where the widget renders, its static copy is hidden"

    # The reader sets the first chart to log scale; the notebook is saved with widget state.
    page.locator(".ipydist-metrics").first.locator(".ipydist-toggle-log").first.check()
    _save(page)
    saved = nbformat.read(lab.root / RESTARTS, as_version=4)
    assert "widgets" in saved.metadata, "JupyterLab saved the widget state"

    # Reopened with its widget state: the widgets come back with the reader's settings.
    again = _reopen(page, lab)
    assert [w["points"] for w in again["widgets"]] == ["40", "40", "40"], again
    assert again["widgets"][0]["log"] == [True, False], "log scale on the first chart, kept"
    assert not again["errors"] and again["fallbacks_shown"] == 0, again

    # Saved without widget state (JupyterLab's default), trusted as a notebook one saved
    # oneself is: each static copy shows, and no "model not found" box (ipywidgets still
    # logs that it found no model for each widget output: expected here, and only here).
    allowed.append(WIDGET_STATE_NOT_SAVED)
    path = lab.root / RESTARTS
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets")
    nbformat.write(nb, path)
    lab.trust(path)
    bare = _reopen(page, lab)
    assert not bare["errors"], f"error boxes in a notebook reopened without widget state: {bare}"
    assert not bare["widgets"]
    assert bare["fallback_charts"] == [2, 2, 2], bare

    # The same in Notebook 7, served by the same server (whose own page errors are allowed).
    allowed.extend(NOTEBOOK7_OWN_ERRORS)
    classic = _reopen(page, lab, f"/notebooks/{RESTARTS}")
    assert not classic["errors"] and classic["fallback_charts"] == [2, 2, 2], classic
