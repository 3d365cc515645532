"""Notebooks run top to bottom as a person runs them, in JupyterLab and in Notebook 7: Run All
on the failure notebook goes on past the cells that fail on purpose, and shows every cell's
output where it belongs; progress bars on several ranks are one line per rank, redrawn in
place, in order with what the ranks printed around them. Messages read as a person reads
them: wrapped at spaces, rank sets written out. Any page error fails a test
(``lab_server.browser_page``) unless it says why it expects one.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from helpers import CHROMIUM, as_merged, unwrapped
from lab_server import (
    NOTEBOOK7_OWN_ERRORS,
    REPO,
    browser_page,
    open_notebook,
    ran,
    run_all_cells,
    running,
    serve,
)

from ipydist.errors import MESSAGE_WIDTH

FAILURES = REPO / "notebooks" / "05-failure-recovery.ipynb"
SCRATCH = "scratch.ipynb"
FRONT_ENDS = ["jupyterlab", "notebook7"]
#: The failure notebook takes about a minute per front end; Notebook 7 runs the same Run All
#: code as JupyterLab (@jupyterlab/notebook), so `make test` runs it in JupyterLab only and
#: `make stress` (IPYDIST_TEST_STRESS=1) in both. The scratch notebook runs in both always.
FAILURE_FRONT_ENDS = FRONT_ENDS if os.environ.get("IPYDIST_TEST_STRESS") else ["jupyterlab"]
#: A scratch notebook: each rank prints a line, runs a tqdm bar (rank 1 at half the speed),
#: prints another.
SCRATCH_CELLS = ["%load_ext ipydist\n%dist_start --np 2", """%%everyrank
import time
from tqdm import tqdm
import ipydist.torch as hvd
print(f"hello from rank {hvd.rank()}")
for i in tqdm(range(50), mininterval=0.05):
    time.sleep(0.03 * (1 + hvd.rank()))
print(f"done on rank {hvd.rank()}")""", "%dist_stop"]

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing: run scripts/ensure-chromium.sh (make test does)",
)

#: Every code cell as the page shows it: prompt, source, and each output's text, in order.
READ_CELLS = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')].map((c) => ({
    prompt: (c.querySelector('.jp-InputPrompt')?.textContent ?? '').trim(),
    source: c.querySelector('.jp-InputArea .cm-content')?.innerText ?? '',
    outputs: [...c.querySelectorAll('.jp-OutputArea-output')].map((o) => o.innerText),
}))"""


@pytest.fixture
def console() -> list[str]:
    return []


@pytest.fixture
def allowed(front_end) -> list[re.Pattern]:
    return list(NOTEBOOK7_OWN_ERRORS) if front_end == "notebook7" else []


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving the failure notebook and the scratch notebook."""
    kernel = nbformat.read(FAILURES, as_version=4).metadata["kernelspec"]
    scratch = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in SCRATCH_CELLS],
        metadata={"kernelspec": kernel})
    with serve(tmp_path, {FAILURES.name: FAILURES, SCRATCH: scratch}) as server:
        yield server


@pytest.fixture
def page(request, lab, console, allowed):
    """A page, closed before the server stops (whose end it would report as errors)."""
    with browser_page(console, f"browser-{request.node.name}", allowed) as pg:
        yield pg


def _wait_until_run(page, timeout: float, watch=None) -> list[dict]:
    """Poll until no cell is queued or running (Run All has ended, however it ended), and
    still none a second later; ``watch(cells)`` sees each reading."""
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        cells = page.evaluate(READ_CELLS)
        if watch:
            watch(cells)
        if cells and not any(running(c["prompt"]) for c in cells):
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:
                return cells
        else:
            quiet_since = None
        time.sleep(0.05)
    pytest.fail(f"still running after {timeout:.0f} s: {[c['prompt'] for c in cells]}")


def _cell(cells: list[dict], marker: str) -> dict:
    found = [c for c in cells if marker in c["source"]]
    assert len(found) == 1, f"{len(found)} cells hold {marker!r}"
    return found[0]


def _number(prompt: str) -> int:
    return int(re.search(r"\d+", prompt).group())


def _long_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > MESSAGE_WIDTH]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("front_end", FAILURE_FRONT_ENDS)
def test_run_all_goes_through_the_failure_notebook(lab, front_end, page, console):
    open_notebook(page, lab, FAILURES.name, console, notebook7=front_end == "notebook7")
    run_all_cells(page)
    cells = _wait_until_run(page, timeout=240)
    prompts = [c["prompt"] for c in cells]
    last = [c for c in cells if ran(c["prompt"])][-1:]
    assert all(ran(p) for p in prompts), f"Run All stopped: {prompts}, after {last}"

    raised = _cell(cells, 'raise ValueError("bad batch on rank 3")')
    text = "\n".join(raised["outputs"])
    assert "rank 3 raised in the cell: ValueError: bad batch on rank 3" in unwrapped(text), text
    # the rank's traceback names the cell by the number the page shows
    assert f"Cell In[{_number(raised['prompt'])}]" in text, (raised["prompt"], text)
    assert "sum of ranks: 6" in "\n".join(_cell(cells, 'f"sum of ranks: {')["outputs"])

    timed_out = "\n".join(_cell(cells, "--timeout 3")["outputs"])
    assert "CellTimeout: the cell ran past --timeout 3 s" in unwrapped(timed_out), timed_out
    assert not _long_lines(timed_out), timed_out
    stalled = "\n".join(_cell(cells, "time.sleep(6)")["outputs"])
    assert "ipydist stall warning" in stalled and "ranks in the allreduce: 4" in unwrapped(stalled)
    warning = stalled[stalled.index("ipydist stall warning"):]
    assert not _long_lines(warning.split("ranks in the allreduce")[0]), warning

    died = "\n".join(_cell(cells, "signal.SIGKILL)")["outputs"])
    assert "RankDied" in died and "rank 2 is being replaced" in unwrapped(died), died
    assert not _long_lines(died), died
    healed = "\n".join(_cell(cells, "{ranks:g} ranks, epoch")["outputs"])
    assert "rank 2 was replaced in" in unwrapped(healed), healed
    assert "[all ranks] 4 ranks, epoch" in as_merged(healed), healed
    new = "\n".join(_cell(cells, "sum of ranks on the new cluster")["outputs"])
    assert "sum of ranks on the new cluster: 6" in new, new


BAR = re.compile(r"^\[(rank \d|all ranks)\]\s+(\d+)%\|", re.M)


def _bars(outputs: list[str]) -> list[tuple[int, str, int]]:
    """(output index, tag, percent) of every progress bar line in the outputs."""
    return [(i, m.group(1), int(m.group(2)))
            for i, text in enumerate(outputs) for m in BAR.finditer(text)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_progress_bar_on_every_rank_is_one_line_each_redrawn_in_place(
        lab, front_end, page, console):
    seen: list[list[tuple[int, str, int]]] = []

    def watch(cells):
        if len(cells) > 1 and running(cells[1]["prompt"]):
            seen.append(_bars(cells[1]["outputs"]))

    open_notebook(page, lab, SCRATCH, console, notebook7=front_end == "notebook7")
    run_all_cells(page)
    cells = _wait_until_run(page, timeout=180, watch=watch)
    assert all(ran(c["prompt"]) for c in cells), [c["prompt"] for c in cells]
    outputs = cells[1]["outputs"]
    bars = _bars(outputs)
    # one line per rank, never merged, at 100 % in the end
    assert sorted((tag, pct) for _, tag, pct in bars) == [("rank 0", 100), ("rank 1", 100)], (
        outputs)
    # while it ran: never a second line for a rank, and the line changed in place
    assert seen, "no reading was taken while the cell ran"
    for reading in seen:
        tags = [tag for _, tag, _ in reading]
        assert "all ranks" not in tags and len(tags) == len(set(tags)), reading
    shown = {pct for reading in seen for _, tag, pct in reading if tag == "rank 1"}
    assert len(shown) >= 2, f"rank 1's bar was not redrawn while the cell ran: {seen}"
    # each rank's bar in order with what that rank printed around it (ranks run apart: one
    # rank's bar may come before another rank's first line)
    def where(text: str) -> int:
        found = [i for i, output in enumerate(outputs) if text in output]
        assert len(found) == 1, (text, outputs)
        return found[0]

    for rank in (0, 1):
        bar = next(i for i, tag, _ in bars if tag == f"rank {rank}")
        assert where(f"[rank {rank}] hello from rank {rank}") < bar < where(
            f"[rank {rank}] done on rank {rank}"), outputs
