"""Completion and help for code that runs on the ranks, through a real Jupyter kernel
(jupyter_client's ``complete_request`` and ``inspect_request``, as JupyterLab sends them):
answered by rank 0, where the names live, and by the notebook elsewhere."""

from __future__ import annotations

import pytest
from jupyter_client.manager import start_new_kernel

START = "%load_ext ipydist\n%dist_start --np 2"


def run(kc, code: str) -> None:
    reply = kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", code


def complete(kc, code: str, cursor_pos: int | None = None) -> dict:
    kc.complete(code, len(code) if cursor_pos is None else cursor_pos)
    return kc.get_shell_msg(timeout=30)["content"]


def inspect(kc, code: str, cursor_pos: int | None = None) -> dict:
    kc.inspect(code, len(code) if cursor_pos is None else cursor_pos)
    return kc.get_shell_msg(timeout=30)["content"]


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, START)
        run(kc, "%%everyrank\nimport torch\nmodel = torch.nn.Linear(4, 2)\n"
                "settings = {'learning_rate': 0.1, 'epochs': 3}")
        run(kc, "notebook_only_name = 1")
        yield kc
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def test_names_of_rank_0_complete_in_an_everyrank_cell(kernel):
    code = "%%everyrank\nmodel.para"
    reply = complete(kernel, code)
    assert "parameters" in reply["matches"], reply
    assert code[reply["cursor_start"]:reply["cursor_end"]] == "para", reply
    types = reply["metadata"]["_jupyter_types_experimental"]
    assert [t["text"] for t in types] == reply["matches"], "one type per match, in order"
    assert all((t["start"], t["end"]) == (reply["cursor_start"], reply["cursor_end"])
               for t in types)
    keys = complete(kernel, "%%everyrank\nx = settings['lea")
    assert any("learning_rate" in m for m in keys["matches"]), keys
    # the notebook's own names are not the ranks'
    mine = complete(kernel, "%%everyrank\nnotebook_only_na")
    assert "notebook_only_name" not in mine["matches"], mine


def test_the_notebook_answers_for_its_own_code_and_the_magic_line(kernel):
    assert "notebook_only_name" in complete(kernel, "notebook_only_na")["matches"]
    assert "model" not in complete(kernel, "mode")["matches"]
    line = "%%everyrank --ra"
    options = complete(kernel, line + "\nmodel.para", len(line))  # the notebook's completer
    assert options["status"] == "ok" and "parameters" not in options["matches"], options
    assert options["cursor_end"] <= len(line), options


def test_help_comes_from_rank_0_and_names_it(kernel):
    code = "%%everyrank\nmodel"
    reply = inspect(kernel, code)
    assert reply["found"], reply
    text = reply["data"]["text/plain"]
    assert text.startswith("[rank 0]\n") and "Linear" in text, text
    assert not inspect(kernel, "model")["found"], "no model in the notebook"


def test_everyrank_mode_cells_complete_on_rank_0(kernel):
    run(kernel, "%dist_mode everyrank")
    try:
        assert "parameters" in complete(kernel, "model.para")["matches"]
    finally:
        run(kernel, "%dist_mode local")
