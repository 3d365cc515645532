"""The live cluster view in JupyterLab, in a real browser: ``%dist_status --live`` draws 4
ranks, their state changes when a cell runs (rank 3 running it, the others waiting for it in
an allreduce), and its Interrupt button interrupts the cell on every rank (through the Jupyter
server, as the toolbar's stop button does). The start's own view is there, collapsed. The
screenshot is the one the docs show (``IPYDIST_UPDATE_SCREENSHOT=1`` copies it to
docs/cluster-view.png).

Needs ``/usr/bin/chromium`` (``scripts/ensure-chromium.sh``, which ``make test`` runs).
"""

from __future__ import annotations

from lab_server import (
    NEEDS_CHROMIUM,
    browser_page,
    docs_screenshot,
    notebook_of,
    open_notebook,
    run_all_cells,
    serve,
)

NOTEBOOK = "cluster-view.ipynb"
CELLS = [
    "%load_ext ipydist\n%dist_start --np 4",
    # a chart on the page: its stylesheet once laid out the view's rows as flex boxes
    "%%everyrank\nimport ipydist.torch as hvd\nhvd.log(step=1, total=2, loss=0.5)",
    "%dist_status --live",
    "%%everyrank\nimport time, torch, ipydist.torch as hvd\nif hvd.rank() == 3:\n"
    "    time.sleep(120)\ntorch.distributed.all_reduce(torch.ones(1))",
    "%dist_stop",
]

pytestmark = NEEDS_CHROMIUM



def cell(index: int) -> str:
    return f"document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-CodeCell')[{index}]"


#: The states of the live view's rows (cell 2's output).
STATES = f"""() => [...({cell(2)})?.querySelectorAll('.ipydist-cluster-table tbody tr') ?? []]
    .map((tr) => tr.cells[[...tr.parentNode.parentNode.tHead.rows[0].cells]
        .findIndex((th) => th.textContent === 'state')].textContent)"""


def test_the_live_view_shows_the_ranks_and_interrupts_a_cell(tmp_path):
    console: list[str] = []
    with serve(tmp_path, {NOTEBOOK: notebook_of(CELLS)}) as lab, \
            browser_page(console, "browser-cluster-view", []) as page:
        open_notebook(page, lab, NOTEBOOK, console)
        run_all_cells(page)
        page.wait_for_function(
            f"""() => {{ const s = ({STATES})();
                return s.length === 4 && s[3].startsWith('running cell')
                    && s.slice(0, 3).every((t) => /^waiting in all_reduce for [1-9]/.test(t));
            }}""",
            timeout=180_000)
        # the columns line up: each header cell starts where its column's cells do
        lefts = page.evaluate(f"""() => [...({cell(2)}).querySelectorAll(
            '.ipydist-cluster-table tr')].map((tr) => [...tr.cells].map(
                (c) => Math.round(c.getBoundingClientRect().left)))""")
        assert len(lefts) == 5 and all(row == lefts[0] for row in lefts), lefts
        start_view = page.evaluate(
            f"() => ({cell(0)}).querySelector('.ipydist-cluster-caption')?.textContent ?? ''")
        assert start_view.startswith("▸ 4 ranks"), start_view  # collapsed under the start
        view = page.locator(".jp-NotebookPanel .jp-Notebook .jp-CodeCell").nth(2)
        docs_screenshot(view, "cluster-view.png", "cluster-view.png")
        view.locator("button", has_text="Interrupt").click()
        output = f"() => ({cell(3)}).querySelector('.jp-OutputArea')?.innerText ?? ''"
        page.wait_for_function(f"() => /Interrupted/.test(({output})())", timeout=60_000)
        page.wait_for_function(f"() => ({STATES})().every(s => s === 'idle')", timeout=30_000)
        assert "Interrupted ranks 0-3" in page.evaluate(output), page.evaluate(output)
