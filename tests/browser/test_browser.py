"""The live metrics widget in a real browser.

JupyterLab runs the quickstart notebook in Chromium (Debian's package, driven by Playwright) and
the test watches the chart under the training cell fill up while that cell is still running:
this is the one place where the widget's JavaScript, the kernel's comm messages and the ranks'
``hvd.log`` stream are all real at once.

Needs ``/usr/bin/chromium``: ``scripts/ensure-chromium.sh`` installs it (``make test`` runs it
first). Playwright never downloads a browser of its own here.

What the widget promises (its contract with this test): under a running cell that calls
``hvd.log``, an element ``.ipydist-metrics`` with ``data-points`` (points received so far) and
``data-done`` (``"false"`` while the cell runs, ``"true"`` once it ended), and an SVG chart.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest
from helpers import CHROMIUM as CHROMIUM_PATH
from helpers import CHROMIUM_ARGS, MARK_VAR, cluster_processes, wait_gone

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "notebooks" / "01-quickstart.ipynb"
ARTIFACTS = REPO / "test-artifacts"
SCREENSHOT = ARTIFACTS / "browser-quickstart.png"
#: The quickstart's widget alone; ``IPYDIST_UPDATE_SCREENSHOT=1`` copies it to the README's.
WIDGET_SCREENSHOT = ARTIFACTS / "live-metrics.png"
README_SCREENSHOT = REPO / "docs" / "live-metrics.png"
CHROMIUM = Path(CHROMIUM_PATH)
#: The quickstart's training cell logs one point per step (20 epochs x 10 steps) and one per
#: epoch (the test accuracy), from rank 0.
EXPECTED_POINTS = 220
MIN_ACCURACY = 0.9

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (make test does)",
)


# ---------------------------------------------------------------------------------- JupyterLab


@dataclass
class Lab:
    """A JupyterLab server started for one test, in its own process group."""

    proc: subprocess.Popen
    port: int
    token: str
    mark: str
    log: Path
    root: Path
    env: dict

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}?token={self.token}"

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def processes(self, marked: bool = True) -> dict[int, str]:
        """pid -> cmdline of every process this server started (kernel, controller, mpiexec,
        engines): its descendants, plus (``marked``) anything carrying this run's environment
        mark, which costs a look at every process on the machine."""
        found = cluster_processes(self.mark) if marked else {}
        found.pop(self.proc.pid, None)
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                found[p.pid] = _cmdline(p)
        except psutil.Error:
            pass
        return found


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return "?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_without_outputs(src: Path, dst: Path) -> None:
    """The notebook with its outputs cleared, so that a chart saved in it is never mistaken for
    the live one."""
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    dst.write_text(json.dumps(nb, indent=1))


def _write_lab_settings(settings_dir: Path) -> None:
    """User settings for a quiet, test-friendly JupyterLab.

    No news or update prompt (its toast would cover the notebook and it tries the network), and
    every cell kept in the page (the default windowing detaches or skips rendering off-screen
    cells, and the test finds the training cell by its index).
    """
    settings = {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false",
                                                        "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        # Widget state saved with the notebook (JupyterLab's default is not to): the test of
        # a reopened notebook checks both ways, removing the saved state for the second.
        "@jupyter-widgets/jupyterlab-manager/plugin": {"saveState": True},
    }
    for name, values in settings.items():
        path = settings_dir / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _wait_until_serving(lab: Lab, timeout: float = 60.0) -> None:
    """Wait until the server answers its REST API; fail with its log if it dies or never does."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(
        f"http://127.0.0.1:{lab.port}/api/status",
        headers={"Authorization": f"token {lab.token}"},
    )
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with {lab.proc.returncode}:\n{lab.log_tail()}")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    pytest.fail(f"jupyter lab did not answer within {timeout:.0f} s:\n{lab.log_tail()}")


def _stop_lab(lab: Lab) -> None:
    """SIGTERM to the server's process group (it then shuts its kernels down), SIGKILL if it
    has not ended after a few seconds."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(lab.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            lab.proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of the quickstart; on teardown, stopped with everything it
    started, and the test fails if anything had to be killed."""
    root = tmp_path / "root"
    root.mkdir()
    _copy_without_outputs(QUICKSTART, root / QUICKSTART.name)
    nbformat.write(_restarts_notebook(), root / RESTARTS)
    _write_lab_settings(tmp_path / "settings")
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), PYTHONUNBUFFERED="1")
    env[MARK_VAR] = mark = uuid.uuid4().hex
    port, token = _free_port(), secrets.token_hex(16)
    log = tmp_path / "jupyter-lab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
             "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.extension_manager=readonly",
             f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
             f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    server = Lab(proc, port, token, mark, log, root, env)
    try:
        _wait_until_serving(server)
        yield server
    finally:
        started = server.processes()
        _stop_lab(server)
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(log, ARTIFACTS / "browser-quickstart.jupyter.log")
        left = wait_gone(started, timeout=10)
        left_cmds = {pid: started[pid] for pid in left}
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert not left_cmds, f"still running 10 s after JupyterLab stopped (killed): {left_cmds}"


# ------------------------------------------------------------------------------------- browser


@pytest.fixture
def console() -> list[str]:
    """The browser's console messages and page errors, in order."""
    return []


@pytest.fixture
def page(console):
    """A Chromium page; on teardown (passed or failed) a screenshot of it and the browser's
    console messages are saved under test-artifacts/, the things one debugs a widget with."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1400})
            pg.set_default_timeout(60_000)
            pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            try:
                yield pg
            finally:
                try:
                    pg.screenshot(path=str(SCREENSHOT), timeout=10_000)
                except Exception as e:  # a crashed page must not hide the test's own failure
                    console.append(f"(screenshot failed: {e})")
                (ARTIFACTS / "browser-quickstart.console.txt").write_text("\n".join(console))
        finally:
            browser.close()


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
        prompt: cell ? prompt(cell) : '',
        output: cell?.querySelector('.jp-OutputArea')?.textContent ?? '',
        points: widget ? widget.getAttribute('data-points') : null,
        done: widget ? widget.getAttribute('data-done') : null,
        marks: widget ? widget.querySelectorAll('svg path, svg polyline').length : 0,
    };
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


#: True once the status bar reads "<kernel name> | Idle": the kernel has started and answered.
#: (The toolbar's execution indicator says "idle" already before any kernel exists.)
KERNEL_IDLE = """() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
    .some((e) => /^(?!No Kernel).+ \\| Idle$/.test(e.textContent.trim()))"""


def _open_notebook(page, lab: Lab, name: str = QUICKSTART.name) -> None:
    """Open the notebook and wait until its kernel has started and is idle."""
    page.goto(lab.url(f"/lab/tree/{name}"))
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    page.wait_for_function(KERNEL_IDLE)


def _run_all_cells(page) -> None:
    """Run > Run All Cells from the menu bar, as a user would; wait until the run has begun."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    page.wait_for_function(
        """() => [...document.querySelectorAll('.jp-NotebookPanel .jp-InputPrompt')]
            .some((p) => /\\[(\\*|\\d+)\\]/.test(p.textContent))""",
        timeout=15_000,
    )


def _ran(prompt: str) -> bool:
    return re.fullmatch(r"\[\d+\]:?", prompt) is not None


def _running(prompt: str) -> bool:
    """Queued or running: JupyterLab shows both as ``[*]``."""
    return prompt.startswith("[*]")


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
        if not any(_running(p) for p in now["prompts"]):
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
def test_quickstart_live_chart_in_jupyterlab(lab, page, console):
    index = _training_cell_index()
    _open_notebook(page, lab)
    before = lab.processes(marked=False)  # the kernel; everything new from here on is the cluster
    assert before, "the notebook's kernel says idle but JupyterLab has no child process"
    _run_all_cells(page)
    readings, end, seen = _watch_run(page, lab, index)

    # The notebook itself: every cell ran (a failing cell stops Run All), training converged.
    assert end["ncells"] == len(json.loads(QUICKSTART.read_text())["cells"]), end
    assert all(_ran(p) for p in end["prompts"]), (
        f"not every cell ran: {end['prompts']}\n{console[-20:]}")
    match = re.search(r"final test accuracy:\s*(\d+(?:\.\d+)?)", end["output"])
    assert match, f"no 'final test accuracy' in the training cell:\n{end['output'][-2000:]}"
    assert float(match.group(1)) >= MIN_ACCURACY, match.group(0)

    # %dist_stop, the last cell, ended the cluster: mpiexec, engines, controller.
    cluster = {pid: cmd for pid, cmd in seen.items() if pid not in before}
    assert cluster, "no cluster process was seen while the notebook ran"
    left = wait_gone(cluster, timeout=10)
    assert not left, f"%dist_stop left these running: {[cluster[p] for p in left]}"

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
    live = [int(r["points"]) for r in readings if _running(r["prompt"]) and r["done"] == "false"]
    assert len(set(live)) >= 2, (
        "data-points of .ipydist-metrics did not rise while the training cell ran; readings "
        f"while it ran: {live[:50]}; after: points={end['points']} done={end['done']}\n{messages}")
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
        if prompts and all(_ran(p) for p in prompts):
            return
        time.sleep(0.25)
    pytest.fail(f"the notebook did not finish within {timeout:.0f} s: {prompts}")


def _save(page) -> None:
    page.locator(".jp-NotebookPanel").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    page.wait_for_function("() => !document.querySelector('.jp-NotebookPanel .jp-mod-dirty')"
                           " && !document.title.startsWith('*')")
    time.sleep(0.5)


def _end_sessions(lab: Lab) -> None:
    """Shut down every kernel, as closing JupyterLab and coming back another day does."""
    def call(method, path):
        request = urllib.request.Request(
            f"http://127.0.0.1:{lab.port}{path}", method=method,
            headers={"Authorization": f"token {lab.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    for session in call("GET", "/api/sessions"):
        call("DELETE", f"/api/sessions/{session['id']}")


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
    _end_sessions(lab)
    page.goto(lab.url(path))
    page.wait_for_selector(".jp-Notebook .jp-Cell .ipydist-fallback")
    page.wait_for_function(WIDGETS_SETTLED, arg=widgets, timeout=60_000)
    return page.evaluate(READ_OUTPUTS)


@pytest.mark.timeout(420)
def test_points_survive_restarts_and_a_reopened_notebook_shows_its_charts(lab, page, console):
    _open_notebook(page, lab, RESTARTS)
    _run_all_cells(page)
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
    # oneself is: each static copy shows, and no "model not found" box.
    path = lab.root / RESTARTS
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets")
    nbformat.write(nb, path)
    subprocess.run([sys.executable, "-m", "jupyter", "trust", str(path)], check=True,
                   capture_output=True, env=dict(os.environ, **lab.env))
    bare = _reopen(page, lab)
    assert not bare["errors"], f"error boxes in a notebook reopened without widget state: {bare}"
    assert not bare["widgets"]
    assert bare["fallback_charts"] == [2, 2, 2], bare

    # The same in Notebook 7, served by the same server.
    classic = _reopen(page, lab, f"/notebooks/{RESTARTS}")
    assert not classic["errors"] and classic["fallback_charts"] == [2, 2, 2], classic
