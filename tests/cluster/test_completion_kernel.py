"""Completion and help for code that runs on the ranks, through a real Jupyter kernel
(jupyter_client's ``complete_request`` and ``inspect_request``, as JupyterLab sends them):
answered by rank 0 (or the first of a cell's ``--ranks``), where the names live, and by the
notebook elsewhere; while a cell runs too, from a subshell of the kernel; never by running a
property of the user's."""

from __future__ import annotations

import time

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


#: A property that counts its calls: completing ``trap.value.`` must not call it (on a real
#: model such a property could start a collective, and hang the rank).
TRAP = """%%everyrank
class Trap:
    calls = 0

    @property
    def value(self):
        Trap.calls += 1
        return "text"

trap = Trap()"""


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, START)
        run(kc, "%%everyrank\nimport torch\nmodel = torch.nn.Linear(4, 2)\n"
                "settings = {'learning_rate': 0.1, 'epochs': 3}")
        run(kc, "%%everyrank --ranks 1\nonly_on_rank_one = 1")
        run(kc, TRAP)
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


def test_the_first_of_a_cells_ranks_answers(kernel):
    code = "%%everyrank --ranks 1\nonly_on_rank_o"
    assert "only_on_rank_one" in complete(kernel, code)["matches"]
    assert "only_on_rank_one" not in complete(kernel, "%%everyrank\nonly_on_rank_o")["matches"]
    reply = inspect(kernel, "%%everyrank --ranks 1\nonly_on_rank_one")
    assert reply["found"] and reply["data"]["text/plain"].startswith("[rank 1]\n"), reply


def test_completion_runs_no_property(kernel):
    complete(kernel, "%%everyrank\ntrap.value.")
    inspect(kernel, "%%everyrank\ntrap.value")
    run(kernel, "%%everyrank\nassert Trap.calls == 0, f'the property ran {Trap.calls} times'")


def test_help_asked_in_a_cell_goes_to_the_pager(kernel):
    """``model?`` in an everyrank cell: rank 0's help, named, in the notebook's pager (as
    ``obj?`` shows it in a one-process notebook), once, not once per rank."""
    reply = kernel.execute_interactive("%%everyrank\nmodel?", timeout=60,
                                       output_hook=lambda msg: None)
    pages = [p for p in reply["content"].get("payload", []) if p.get("source") == "page"]
    assert len(pages) == 1, reply["content"]
    text = pages[0]["data"]["text/plain"]
    assert text.startswith("[rank 0]\n") and "Linear" in text, text


def test_completion_while_a_cell_runs_from_a_subshell(kernel):
    """A 30 s cell runs on every rank; a completion sent to a subshell of the kernel (as a
    front end that uses ipykernel 7's subshells sends it) is answered by rank 0 at once, from
    its namespace as it is; then the stop button ends the cell."""
    kc = kernel
    msg = kc.session.msg("create_subshell_request", {})
    kc.control_channel.send(msg)
    subshell = kc.control_channel.get_msg(timeout=10)["content"]["subshell_id"]
    main = kc.execute("%%everyrank\nimport time\nduring_the_cell = 1\ntime.sleep(30)")
    time.sleep(3)
    code = "%%everyrank\nduring_the_ce"
    request = kc.session.msg("complete_request", {"code": code, "cursor_pos": len(code)})
    request["header"]["subshell_id"] = subshell
    kc.shell_channel.send(request)
    replies = {}
    while request["header"]["msg_id"] not in replies:
        reply = kc.get_shell_msg(timeout=20)
        replies[reply["parent_header"]["msg_id"]] = reply
    reply = replies[request["header"]["msg_id"]]
    # rank 0 answered (a rank that does not answer gives no matches; the benchmark measures
    # the latency: benchmarks/completion.py)
    assert "during_the_cell" in reply["content"]["matches"], reply["content"]
    assert main not in replies, "the cell was still running"
    kernel_manager = kc.parent
    kernel_manager.interrupt_kernel()
    deadline = time.monotonic() + 60
    while main not in replies and time.monotonic() < deadline:
        reply = kc.get_shell_msg(timeout=60)
        replies[reply["parent_header"]["msg_id"]] = reply
    assert replies[main]["content"]["status"] == "error"  # interrupted
    run(kc, "%%everyrank\nassert during_the_cell == 1")
