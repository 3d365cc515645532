"""Tab in an ``%%everyrank`` cell in JupyterLab, in a real browser: the completer lists the
attributes of the model that rank 0 holds (the notebook's kernel has no ``model``), and
Shift-Tab's tooltip shows rank 0's help, headed ``[rank 0]``.

Needs ``/usr/bin/chromium`` (``scripts/ensure-chromium.sh``, which ``make test`` runs).
"""

from __future__ import annotations

from lab_server import NEEDS_CHROMIUM, browser_page, notebook_of, open_notebook, ran, serve
from playwright.sync_api import TimeoutError as PlaywrightTimeout

NOTEBOOK = "completion.ipynb"
CELLS = [
    "%load_ext ipydist\n%dist_start --np 2",
    "%%everyrank\nimport torch\nmodel = torch.nn.Linear(4, 2)",
    "%%everyrank\nmodel.para",
]
CELL = ".jp-NotebookPanel .jp-Notebook .jp-CodeCell"

pytestmark = NEEDS_CHROMIUM



def run_cell(page, index: int) -> None:
    """Select cell ``index`` and run it (Shift-Enter), waiting for its prompt to say it ran."""
    page.locator(CELL).nth(index).locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        f"""() => /^\\[\\d+\\]:?$/.test(document.querySelectorAll('{CELL}')[{index}]
            .querySelector('.jp-InputPrompt').textContent.trim())""", timeout=180_000)


def press_until_shown(page, key: str, popup, tries: int = 3) -> None:
    """Press ``key`` until ``popup`` shows, as a user presses Tab again: a rank that cannot
    answer in time (its first answer loads jedi, seconds on a busy machine) gives an empty
    reply, which JupyterLab shows as nothing, and goes on loading for the next press."""
    for attempt in range(tries):
        page.keyboard.press(key)
        try:
            popup.wait_for(timeout=20_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise


def test_tab_completes_rank_side_names(tmp_path):
    console: list[str] = []
    with serve(tmp_path, {NOTEBOOK: notebook_of(CELLS)}) as lab, \
            browser_page(console, "browser-completion", []) as page:
        open_notebook(page, lab, NOTEBOOK, console)
        run_cell(page, 0)
        run_cell(page, 1)
        prompt = page.locator(CELL).nth(1).locator(".jp-InputPrompt").text_content()
        assert ran(prompt.strip()), prompt
        editor = page.locator(CELL).nth(2).locator(".cm-content")
        editor.click()
        page.keyboard.press("Control+End")  # after "model.para"
        completer = page.locator(".jp-Completer:visible")
        press_until_shown(page, "Tab", completer)
        items = completer.locator(".jp-Completer-item").all_text_contents()
        assert any("parameters" in item for item in items), items
        page.keyboard.press("Escape")
        page.keyboard.press("Backspace")  # "model.par" -> "model" then ask for help on it
        for _ in range(4):
            page.keyboard.press("Backspace")
        tooltip = page.locator(".jp-Tooltip:visible")
        press_until_shown(page, "Shift+Tab", tooltip)
        text = tooltip.inner_text()
        assert "rank 0" in text and "Linear" in text, text
