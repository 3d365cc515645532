"""The quickstart notebook, run headless through ``ipydist run`` as a user would run it.

The notebook starts 4 real ranks under mpiexec and trains for a few seconds, so it runs once
per module (``executed``) and every check below reads that one executed copy.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest

from ipydist import cli

QUICKSTART = Path(__file__).resolve().parents[1] / "notebooks" / "01-quickstart.ipynb"
#: Set in the environment the notebook's kernel (and so its ranks) inherit, so that the
#: leftover check sees only this run's processes, not another session's on the same machine.
MARK_VAR = "IPYDIST_TEST_RUN"


def _engines_with_mark(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid == os.getpid() or "ipydist.engine" not in " ".join(
                proc.info["cmdline"] or []
            ):
                continue
            if proc.environ().get(MARK_VAR) == mark:
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Run the quickstart once; yield (executed notebook, seconds taken, leftover engines)."""
    out = tmp_path_factory.mktemp("executed") / QUICKSTART.name
    mark = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MARK_VAR, mark)
        t0 = time.perf_counter()
        assert cli.main(["run", str(QUICKSTART), "--np", "4", "--output", str(out)]) == 0
        seconds = time.perf_counter() - t0
    deadline = time.monotonic() + 10
    while (left := _engines_with_mark(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return nbformat.read(out, as_version=4), seconds, left


def _cell(nb, needle: str):
    return next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)


def _text(cell) -> str:
    """Everything a cell showed, as plain text."""
    parts = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            parts.append(o.text)
        elif "data" in o:
            parts.append(o.data.get("text/plain", ""))
    return "".join(parts)


def test_no_cell_errored(executed):
    nb, _, _ = executed
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    assert all(c.execution_count for c in nb.cells if c.cell_type == "code")


def test_dist_start_shows_rank_table(executed):
    text = _text(_cell(executed[0], "%dist_start"))
    assert re.search(r"^rank\s+host\s+pid\s+device\s+backend", text, re.MULTILINE), text
    for r in range(4):
        assert re.search(rf"^{r}\s+\S+\s+\d+\s+\S+", text, re.MULTILINE), text
    assert "4 ranks ready" in text


def test_allreduce_sums_ranks(executed):
    text = _text(_cell(executed[0], "op=hvd.Sum"))
    assert re.search(r"sum of ranks: 6(\.0)?$", text, re.MULTILINE), text


def test_training_reaches_accuracy(executed):
    text = _text(_cell(executed[0], "hvd.allreduce_(p.grad"))
    assert len(re.findall(r"epoch\s+\d+\s+loss \d\.\d{4}", text)) >= 15, text
    match = re.search(r"^\[rank 0\] final test accuracy: (\d\.\d{4})$", text, re.MULTILINE)
    assert match, text
    assert float(match.group(1)) >= 0.93


def test_state_survives_between_cells(executed):
    nb = executed[0]
    # identical weights everywhere: the line is merged into one for all ranks
    assert "[all ranks] weights checksum:" in _text(_cell(nb, "checksum"))
    pulled = _cell(nb, "%dist_pull")
    assert any("image/png" in o.get("data", {}) for o in pulled.outputs)
    assert "Stopped 4 ranks." in _text(_cell(nb, "%dist_stop"))


def test_nothing_left_running(executed):
    left = executed[2]
    assert left == [], [p.cmdline() for p in left]


def test_demo_prints_accuracy(executed, tmp_path, monkeypatch, capsys):
    """``demo`` finds the quickstart and reports its accuracy line.

    Its execution is the ``run_notebook`` checked above, so here the module's executed copy
    stands in for a second 25-second run.
    """
    calls = []

    def already_run(notebook, np=None, output=None, timeout=cli.DEFAULT_CELL_TIMEOUT):
        calls.append((Path(notebook), np))
        out = tmp_path / "executed" / Path(notebook).name
        out.parent.mkdir()
        nbformat.write(executed[0], out)
        return out

    monkeypatch.setattr(cli, "run_notebook", already_run)
    monkeypatch.chdir(tmp_path)  # no notebooks/ here: demo must fall back to the source tree
    assert cli.main(["demo", "--np", "4"]) == 0
    assert calls == [(QUICKSTART, 4)]
    out = capsys.readouterr().out
    assert re.search(r"^executed notebook: executed/01-quickstart\.ipynb", out, re.MULTILINE)
    match = re.search(r"^final test accuracy: (\d\.\d{4})$", out, re.MULTILINE)
    assert match, out
    assert float(match.group(1)) >= 0.93


def test_set_np_rewrites_dist_start():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%load_ext ipydist\n%dist_start --np 4 --gpus none"),
        nbformat.v4.new_code_cell("%dist_start --np=2"),
        nbformat.v4.new_code_cell("%dist_start"),
        nbformat.v4.new_markdown_cell("%dist_start --np 4"),
    ])
    assert cli.set_np(nb, 3) == 3
    assert [c.source for c in nb.cells] == [
        "%load_ext ipydist\n%dist_start --np 3 --gpus none",
        "%dist_start --np 3",
        "%dist_start --np 3",
        "%dist_start --np 4",
    ]


def test_run_reports_failed_cell(tmp_path, capsys):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("raise ValueError('no good\\nsecond line')"),
    ])
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", str(path)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ipydist run: {path}: cell 2 (raise ValueError")
    assert "failed: ValueError: no good (executed copy:" in err[-1]
    assert (tmp_path / "executed" / "broken.ipynb").is_file()


def test_demo_without_quickstart(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "a" / "b" / "cli.py"))
    with pytest.raises(SystemExit):
        cli.main(["demo"])
    assert "cannot find notebooks/01-quickstart.ipynb" in capsys.readouterr().err


CNN = QUICKSTART.parent / "02-train-cnn.ipynb"


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    out = tmp_path_factory.mktemp("executed") / CNN.name
    assert cli.main(["run", str(CNN), "--output", str(out)]) == 0
    return nbformat.read(out, as_version=4)


def test_cnn_notebook_restarts_from_its_checkpoint_and_reaches_the_bar(cnn):
    errors = [o for c in cnn.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    text = "".join(_text(c) for c in cnn.cells if c.cell_type == "code")
    assert len(re.findall(r"\[rank 0\] epoch\s+\d+\s+loss", text)) == 10
    assert "identical to before the restart on every rank: True" in text
    assert "resumed at epoch 5" in text
    match = re.search(r"^\[rank 0\] final test accuracy: (\d\.\d{4})$", text, re.MULTILINE)
    assert match and float(match.group(1)) >= 0.95, text


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _metrics_outputs(nb):
    """The training cell's outputs, the index of its widget, and the widget's saved state."""
    outputs = _cell(nb, "hvd.allreduce_(p.grad").outputs
    i = next(k for k, o in enumerate(outputs) if WIDGET_VIEW in o.get("data", {}))
    model_id = outputs[i].data[WIDGET_VIEW]["model_id"]
    return outputs, i, nb.metadata["widgets"][WIDGET_STATE]["state"][model_id]["state"]


def test_training_chart_is_saved_as_widget_state_with_every_point(executed):
    outputs, i, state = _metrics_outputs(executed[0])
    final = next(k for k, o in enumerate(outputs) if "final test accuracy" in o.get("text", ""))
    assert i < final, "the widget appears while the cell runs, above its last output"
    assert state["done"] is True
    stats = state["stats"]
    assert stats["points"] == 200 and stats["progress"] == 1.0 and stats["step"] == 199
    steps, losses = state["series"]["loss"]
    assert steps == list(range(200)) and len(losses) == 200, "200 points: none dropped"
    assert losses[-1] < losses[0]
    assert stats["steps_per_s"] > 0 and stats["samples_per_s"] > stats["steps_per_s"]
    assert [r["rank"] for r in stats["ranks"]] == [0, 1, 2, 3]
    assert all(r["step_s"] > 0 for r in stats["ranks"])


def test_training_chart_has_a_static_copy_for_nbconvert_and_github(executed):
    from nbconvert import HTMLExporter

    outputs, i, state = _metrics_outputs(executed[0])
    static = outputs[i + 1].data["text/html"]
    assert f'class="ipydist-fallback ipydist-fallback-{state["key"]}"' in static
    assert static.count("<polyline") == 1 and "200 points" in static
    assert outputs[i + 1].data["text/plain"].startswith("[metrics] loss ")
    page, _ = HTMLExporter().from_notebook_node(executed[0])
    assert "ipydist-fallback" in page and "<polyline" in page, "the curve is in nbconvert's HTML"
