"""Server-side execution (the ``durable`` extra: jupyter-server-nbmodel with
jupyter-collaboration), where the server runs the cells and writes their output into the
document, and the page only shows it.

In a trusted notebook (one the person saved, signed as JupyterLab signs it), issue 50's bars:
the page leaves while a ``%%everyrank`` cell prints a line and logs a point each second, and a
new page shows, within 5 s, the lines printed while it was away, in order, with ``[*]``; the
chart renders and its point count grows; no "File Changed" dialog; the stop button stops a
running cell on every rank; ``%dist_start`` leaves its start line, not a stale progress state;
the file the server saved holds every line and a non-empty static chart. In a notebook not
trusted (downloaded, or written by a script), JupyterLab renders no widget: the chart's text
form and, at the end, the static copy show the last values. No console error in either.

Needs ``/usr/bin/chromium`` and the labextension built into the venv (``make test`` does both).
"""

from __future__ import annotations

import json
import re
import time

import pytest
from lab_server import (
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

TRUSTED, UNTRUSTED = "durable.ipynb", "downloaded.ipynb"
#: The training cell's most steps: it ends sooner, once the page has shown it live
#: (``stop_training``), at a step written in this file of the test's folder.
STEPS, STOP = 120, "stop-at"


def _cells(folder) -> list[str]:
    return [
        "%load_ext ipydist\n%dist_start --np 2",
        training_cell(STEPS, folder / STOP),
        "%%everyrank\nimport time\nprint('waiting', flush=True)\ntime.sleep(300)",  # stopped
    ]


SHORT = [
    "%load_ext ipydist\n%dist_start --np 1",
    "%%everyrank\nimport ipydist.torch as hvd\n"
    "for i in range(4):\n"
    "    hvd.log(step=i, total=4, loss=0.5 - i / 10)",
]
DIALOGS = "() => [...document.querySelectorAll('.jp-Dialog')].map((d) => d.innerText)"

pytestmark = NEEDS_CHROMIUM


def _saved(path, ready, timeout: float = 30) -> dict:
    """The notebook as the server last saved it (it saves the shared document by itself, a
    moment after each change), once ``ready`` holds for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            saved = json.loads(path.read_text())
        except ValueError:  # caught while written
            saved = None
        if saved is not None and ready(saved):
            return saved
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not save {path.name} as expected within "
                        f"{timeout:.0f} s: {json.dumps(saved)[:3000]}")
        time.sleep(0.5)


def _text(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell["outputs"]
                   if o["output_type"] == "stream")


def _static_copies(cell: dict) -> list[str]:
    return ["".join(o["data"]["text/html"]) for o in cell["outputs"]
            if "ipydist-fallback" in "".join(o.get("data", {}).get("text/html", ""))]


@pytest.mark.timeout(360)
def test_server_side_execution_survives_a_closed_page_and_saves_a_complete_notebook(tmp_path):
    console: list[str] = []
    notebooks = {TRUSTED: notebook_of(_cells(tmp_path)), UNTRUSTED: notebook_of(SHORT)}
    with serve(tmp_path, notebooks, durable=True, trusted=(TRUSTED,)) as lab, \
            browser_page(console, "browser-durable", []) as page:
        open_notebook(page, lab, TRUSTED, console)
        run_all_cells(page)
        _, _, caught_up = leave_and_come_back(page, lab, TRUSTED)
        steps = stop_training(page, tmp_path / STOP)
        end = wait_for_cell(page, lambda r: ran(r["prompt"]), 120, "the cell did not end")
        assert printed_lines(end["text"]) == list(range(steps)), end["text"]
        assert "done" in end["text"], end["text"]
        assert end["points"] == steps, "the chart has every point"
        copy_hidden = page.evaluate("""() => [...document.querySelectorAll(
            '.jp-CodeCell .ipydist-fallback')].every((e) => e.offsetParent === null)""")
        assert copy_hidden, "the static copy shows beside the chart that rendered"
        start = page.evaluate(READ_CELL, 0)
        assert "2 ranks ready" in start["text"], start
        assert page.evaluate("""() => !!document.querySelectorAll(
            '.jp-NotebookPanel .jp-CodeCell')[0].querySelector('.ipydist-cluster')"""), (
            "the live cluster view under %dist_start did not render")
        # the stop button stops the cell the server runs, on every rank
        wait_for_cell(page, lambda r: "waiting" in r["text"], 30,
                      "the last cell did not start", cell=2)
        page.locator(".jp-NotebookPanel-toolbar [data-jp-item-name='interrupt']").click()
        stopped = wait_for_cell(page, lambda r: ran(r["prompt"]), 30,
                                "the stop button did not stop the cell", cell=2)
        assert "Interrupted ranks 0-1" in stopped["text"], stopped
        assert not page.evaluate(DIALOGS), page.evaluate(DIALOGS)

        saved = _saved(lab.root / TRUSTED, lambda nb: nb["cells"][2]["execution_count"])
        start_cell, training = saved["cells"][:2]
        progress = _text(start_cell).splitlines()
        assert progress[0].startswith("Starting 2 ranks") and progress[-1].startswith(
            "Start: "), f"the start's progress ends with its start line: {progress}"
        assert printed_lines(_text(training)) == list(range(steps)) and "done" in _text(training)
        copies = _static_copies(training)
        assert any("<svg" in c and f"{steps} of {STEPS} steps" in c for c in copies), (
            f"no static chart in the saved file: {copies}")

        # a notebook not trusted: no widget renders; the text says the last values
        console[:] = [m for m in console if "Starting WebSocket" not in m]
        open_notebook(page, lab, UNTRUSTED, console, workspace="downloaded")
        run_all_cells(page)
        short = wait_for_cell(page, lambda r: ran(r["prompt"]) and "last:" in r["text"], 120,
                              "the untrusted notebook's cell did not end with its last values")
        assert short["points"] is None, "a widget rendered in an untrusted notebook"
        assert "ipydist live metrics" in short["text"], short
        assert re.search(r"last: loss 0\.2\b.*4 of 4 steps", short["text"]), short
        assert not page.evaluate(DIALOGS), page.evaluate(DIALOGS)
    print(f"caught up {caught_up:.1f} s after the page opened")
