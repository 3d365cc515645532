"""Close the laptop mid-training and come back: in a plain JupyterLab, the page leaves while a
``%%everyrank`` cell prints a line and logs a point each second, and a new page opens the
notebook (never saved) while the cell still runs.

What the new page must show (issue 50's bars): within 5 s, the lines printed while no page was
there, in order, and the cell running (``[*]``); the chart, whose point count then grows live;
the status bar's "Busy"; the side panel connected while the cell runs; once the cell ends,
every line, "done", the execution count, the cell Run All queued after it, the cell before it
(``%dist_start``'s table), and a saved file that holds every line and a non-empty static
chart. Then the page leaves again while the last cell runs and comes back after it ended: that
cell shows its lines and number, and is saved with its static chart.

Needs ``/usr/bin/chromium`` and the labextension built into the venv (``make test`` does both).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from lab_server import (
    KERNEL_IDLE,
    NEEDS_CHROMIUM,
    READ_CELL,
    browser_page,
    leave_and_come_back,
    notebook_of,
    open_notebook,
    printed_lines,
    ran,
    run_all_cells,
    serve,
    stop_training,
    training_cell,
    wait_for_cell,
)

NOTEBOOK = "reopen.ipynb"
#: The training cell's most steps: it ends sooner, once the page has shown it live
#: (``stop_training``), at a step written in this file of the test's folder.
STEPS, STOP = 120, "stop-at"


def _cells(folder) -> list[str]:
    return [
        "%load_ext ipydist\n%dist_start --np 2",
        # every rank prints the same line: merged, it is shown as soon as both copies came,
        # so the first one comes before the first point, as in a training loop
        training_cell(STEPS, folder / STOP),
        "print('the next cell')",  # queued by Run All: the page that came back follows it too
        # ends while no page is there (the page leaves again as it starts)
        "%%everyrank\nimport time\nimport ipydist.torch as hvd\ntime.sleep(3)\n"
        "for i in range(4):\n"
        "    hvd.log(step=i, total=4, loss=0.5 - i / 10)\n"
        "    if hvd.rank() == 0:\n"
        "        print(f'short {i}', flush=True)\n"
        "    time.sleep(0.5)",
    ]


PANEL = "#ipydist-cluster-panel"

pytestmark = NEEDS_CHROMIUM


def _wait_idle(lab, timeout: float = 60) -> None:
    """Until the server says the kernel is idle (it reads the kernel's status as pages do)."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(f"http://127.0.0.1:{lab.port}/api/kernels",
                                     headers={"Authorization": f"token {lab.token}"})
    while time.monotonic() < deadline:
        with urllib.request.urlopen(request, timeout=10) as response:
            kernels = json.loads(response.read())
        if kernels and all(k["execution_state"] == "idle" for k in kernels):
            return
        time.sleep(0.25)
    pytest.fail(f"the kernel was not idle within {timeout:.0f} s: {kernels}")


def _save(page, path) -> dict:
    """Save with Ctrl+S; the file as written."""
    before = path.stat().st_mtime_ns
    page.locator(".jp-NotebookPanel").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 20
    while path.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            pytest.fail("Ctrl+S did not save the notebook within 20 s")
        page.wait_for_timeout(200)
    page.wait_for_timeout(500)  # (written whole: the server writes a temporary file first)
    return json.loads(path.read_text())


@pytest.mark.timeout(300)
def test_a_page_that_comes_back_mid_cell_catches_up_and_follows_live(tmp_path):
    console: list[str] = []
    with serve(tmp_path, {NOTEBOOK: notebook_of(_cells(tmp_path))}) as lab, \
            browser_page(console, "browser-reopen", []) as page:
        open_notebook(page, lab, NOTEBOOK, console)
        run_all_cells(page)
        _, away, caught_up = leave_and_come_back(page, lab, NOTEBOOK, console)
        # the status bar says the kernel is busy, not "Unknown"
        status = page.evaluate("""() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]
            .map((e) => e.textContent.trim()).join(' / ')""")
        assert "Busy" in status, f"the status bar reads {status!r} while the cell runs"
        # the side panel connects while the cell runs
        page.locator(".jp-SideBar.jp-mod-right .lm-TabBar-tab", has_text="ipydist").click()
        page.wait_for_function(f"""() => [...document.querySelectorAll(
            '{PANEL} .ipydist-cluster-table tbody tr')].some(
            (tr) => tr.cells[3].textContent.startsWith('running cell'))""", timeout=15_000)
        steps = stop_training(page, tmp_path / STOP)
        end = wait_for_cell(page, lambda r: ran(r["prompt"]), 120, "the cell did not end")
        assert printed_lines(end["text"]) == list(range(steps)), end["text"]
        assert "done" in end["text"]
        wait_for_cell(page, lambda r: r["prompt"] == "[3]:" and "the next cell" in r["text"], 30,
                      "the cell queued after the training cell was not shown", cell=2)
        start = page.evaluate(READ_CELL, 0)
        assert start["prompt"] == "[1]:" and "2 ranks ready" in start["text"], start
        # the page leaves again while the last cell runs, and comes back after it ended
        assert page.evaluate(READ_CELL, 3)["prompt"].startswith("[*]")
        page.goto("about:blank")
        _wait_idle(lab)
        page.goto(lab.url(f"/lab/tree/{NOTEBOOK}"))
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
        last = wait_for_cell(page, lambda r: r["prompt"] == "[4]:" and "short 3" in r["text"], 30,
                             "the cell that ended while no page was there was not shown", cell=3)
        assert re.findall(r"short (\d)", last["text"]) == ["0", "1", "2", "3"], last
        page.wait_for_function(KERNEL_IDLE)
        saved = _save(page, lab.root / NOTEBOOK)
    outputs = saved["cells"][1]["outputs"]
    text = "".join("".join(o.get("text", "")) for o in outputs if o["output_type"] == "stream")
    assert printed_lines(text) == list(range(steps)) and "done" in text, text
    kinds = ["chart" if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
             else "line 0" if "line 0\n" in "".join(o.get("text", "")) else ""
             for o in outputs]
    assert kinds.index("chart") < kinds.index("line 0"), f"the chart above the lines: {kinds}"
    static = [o for o in outputs if "ipydist-fallback" in "".join(
        o.get("data", {}).get("text/html", ""))]
    assert static and "<svg" in "".join(static[0]["data"]["text/html"]), (
        f"the saved file has no static chart: {[o.get('data', {}).keys() for o in outputs]}")
    last = saved["cells"][3]
    static = [o for o in last["outputs"] if "ipydist-fallback" in "".join(
        o.get("data", {}).get("text/html", ""))]
    assert last["execution_count"] == 4 and static and "<svg" in "".join(
        static[0]["data"]["text/html"]), f"the last cell as saved: {last}"
    print(f"away {away:.1f} s; caught up {caught_up:.1f} s after the page opened")
