"""Kernel > Restart Kernel while an ``%%everyrank`` cell runs, in JupyterLab in a real browser:
the cell says what became of its ranks (stopped with the kernel), and the live cluster view
under ``%dist_start`` stops saying "running cell" and offering Interrupt. No process is left
(``serve`` fails the test otherwise: the cluster's watchdog ends the ranks with the kernel).

Needs ``/usr/bin/chromium`` and the labextension built into the venv (``make test`` does both).
"""

from __future__ import annotations

import re

from lab_server import (
    KERNEL_IDLE,
    NEEDS_CHROMIUM,
    browser_page,
    notebook_of,
    open_notebook,
    run_all_cells,
    serve,
)

NOTEBOOK = "restart.ipynb"
CELLS = [
    "%load_ext ipydist\n%dist_start --np 2",
    "%%everyrank\nimport time\nprint('sleeping', flush=True)\ntime.sleep(300)",
]
GONE = "the kernel restarted or stopped: its ranks were stopped with it"

pytestmark = NEEDS_CHROMIUM


def cell(index: int) -> str:
    return f"document.querySelectorAll('.jp-NotebookPanel .jp-Notebook .jp-CodeCell')[{index}]"


def test_a_kernel_restart_during_a_cell_says_the_ranks_stopped(tmp_path):
    console: list[str] = []
    with serve(tmp_path, {NOTEBOOK: notebook_of(CELLS)}) as lab, \
            browser_page(console, "browser-restart", []) as page:
        open_notebook(page, lab, NOTEBOOK, console)
        run_all_cells(page)
        output = f"() => ({cell(1)}).querySelector('.jp-OutputArea')?.innerText ?? ''"
        page.wait_for_function(f"() => /sleeping/.test(({output})())", timeout=180_000)
        caption = f"() => ({cell(0)}).querySelector('.ipydist-cluster-caption')?.textContent"
        page.wait_for_function(f"() => /running cell/.test(({caption})())", timeout=30_000)
        page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Kernel$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Restart Kernel…")).click()
        page.locator(".jp-Dialog-button", has_text=re.compile(r"^Restart$")).click()
        page.wait_for_function(f"() => /ranks were stopped with it/.test(({output})())",
                               timeout=30_000)
        page.wait_for_function(f"() => ({caption})()?.includes('{GONE}')", timeout=30_000)
        buttons = page.evaluate(f"() => [...({cell(0)}).querySelectorAll("
                                "'.ipydist-cluster button')].map((b) => b.textContent)")
        assert buttons == [], f"the view of a cluster that is gone offers {buttons}"
        page.wait_for_function(KERNEL_IDLE, timeout=60_000)
