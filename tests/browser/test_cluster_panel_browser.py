"""ipydist's JupyterLab side panel (the prebuilt labextension), in a real browser: opened from
the right sidebar before ipydist is loaded, it says so; once the notebook starts 4 ranks it
shows them, their state changes while a cell runs, and its Interrupt button interrupts the
cell on every rank.

Needs ``/usr/bin/chromium`` (``scripts/ensure-chromium.sh``) and the panel built into the
venv (``make test`` does both: its ``.labextension`` step).
"""

from __future__ import annotations

import re

from lab_server import (
    NEEDS_CHROMIUM,
    browser_page,
    notebook_of,
    open_notebook,
    run_all_cells,
    serve,
)

NOTEBOOK = "cluster-panel.ipynb"
CELLS = [
    "%load_ext ipydist\n%dist_start --np 4",
    "%%everyrank\nimport time\ntime.sleep(120)",
]
PANEL = "#ipydist-cluster-panel"
STATES = f"""() => [...document.querySelectorAll('{PANEL} .ipydist-cluster-table tbody tr')]
    .map((tr) => tr.cells[3].textContent)"""

pytestmark = NEEDS_CHROMIUM



def test_the_side_panel_follows_the_notebooks_cluster(tmp_path):
    console: list[str] = []
    with serve(tmp_path, {NOTEBOOK: notebook_of(CELLS)}) as lab, \
            browser_page(console, "browser-cluster-panel", []) as page:
        open_notebook(page, lab, NOTEBOOK, console)
        page.locator(".jp-SideBar.jp-mod-right .lm-TabBar-tab", has_text="ipydist").click()
        caption = f"() => document.querySelector('{PANEL} .ipydist-cluster-caption')"
        page.wait_for_function(
            f"() => ({caption})()?.textContent.includes('no ipydist in this notebook')",
            timeout=30_000)
        run_all_cells(page)
        page.wait_for_function(
            f"() => ({STATES})().length === 4 && "
            f"({STATES})().every((s) => s.startsWith('running cell'))", timeout=180_000)
        assert page.evaluate(f"() => ({caption})().textContent").startswith("4 ranks")
        # in the sidebar's default width, every number shows: no column cut off ("292 Mi…"
        # once), the host and pid left to each row's tooltip
        table = page.evaluate(f"""() => {{
            const t = document.querySelector('{PANEL} .ipydist-cluster-table');
            const shown = (c) => getComputedStyle(c).display !== 'none';
            return {{head: [...t.tHead.rows[0].cells].filter(shown).map((c) => c.textContent),
                     cut: [...t.querySelectorAll('td, th')].filter(
                        (c) => shown(c) && c.scrollWidth > c.clientWidth + 1)
                        .map((c) => c.textContent),
                     wide: t.scrollWidth > t.parentNode.clientWidth + 1,
                     tip: t.tBodies[0].rows[0].title}}; }}""")
        assert table["head"] == ["rank", "state", "CPU", "memory"], table
        assert not table["cut"] and not table["wide"], table
        assert re.fullmatch(r"rank 0 on \S+, pid \d+", table["tip"]), table
        page.locator(f"{PANEL} button", has_text="Interrupt").click()
        page.wait_for_function(f"() => ({STATES})().every((s) => s === 'idle')",
                               timeout=60_000)
        output = ("() => document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell')[1]"
                  ".querySelector('.jp-OutputArea')?.innerText ?? ''")
        assert "Interrupted ranks 0-3" in page.evaluate(output), page.evaluate(output)
