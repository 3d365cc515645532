"""The kernel's record of the last cells' output (ipydist.notebook.reopen.kept_cells), on
messages as ipykernel sends them: streams joined, displays updated in place, clear_output
(now and on the next output), the bound, which requests are kept, and the "busy" said again
after a request handled beside a running cell. A real kernel and page: test_reopen_kernel.py
and tests/browser/test_reopen_browser.py."""

from __future__ import annotations

import itertools

from ipydist.notebook.reopen import kept_cells
from ipydist.notebook.reopen.kept_cells import DROPPED, KeptCell, OutputKeeper

IOPUB = object()
SHELL = object()


class Session:
    """The part of jupyter_client's Session the keeper wraps: ``send`` returns the message."""

    def __init__(self):
        self.sent: list[tuple[object, dict]] = []
        self._ids = itertools.count()

    def send(self, stream, msg_type, content=None, parent=None, ident=None, **kwargs):
        msg = {"header": {"msg_type": msg_type, "msg_id": f"m{next(self._ids)}"},
               "parent_header": (parent or {}).get("header", {}), "content": content or {}}
        self.sent.append((stream, msg))
        return msg


def _request(msg_id="e1", kind="execute_request", cell_id="c1"):
    return {"header": {"msg_id": msg_id, "msg_type": kind, "session": "page"},
            "metadata": {"cellId": cell_id}}


def test_streams_join_displays_update_in_place_and_clear_output_waits():
    cell = KeptCell("e1")
    cell.apply("execute_input", {"execution_count": 7})
    cell.apply("stream", {"name": "stdout", "text": "a\n"})
    cell.apply("stream", {"name": "stdout", "text": "b\n"})
    cell.apply("display_data", {"data": {"text/plain": "0 %"}, "metadata": {},
                                "transient": {"display_id": "bar"}})
    cell.apply("stream", {"name": "stderr", "text": "warn\n"})
    cell.apply("update_display_data", {"data": {"text/plain": "100 %"}, "metadata": {},
                                       "transient": {"display_id": "bar"}})
    shown = cell.as_message()
    assert shown["execution_count"] == 7
    assert [o["output_type"] for o in shown["outputs"]] == ["stream", "display_data", "stream"]
    assert shown["outputs"][0]["text"] == "a\nb\n"
    assert shown["outputs"][1]["data"] == {"text/plain": "100 %"}
    assert shown["display_ids"] == {"bar": [1]}
    cell.apply("clear_output", {"wait": True})
    assert len(cell.outputs) == 3, "a waiting clear_output clears at the next output"
    cell.apply("stream", {"name": "stdout", "text": "c\n"})
    assert [o["text"] for o in cell.as_message()["outputs"]] == ["c\n"]
    cell.apply("clear_output", {"wait": False})
    assert cell.as_message()["outputs"] == []
    assert not cell.done
    cell.apply("status", {"execution_state": "idle"})
    assert cell.done


def test_a_cell_keeps_the_end_of_its_output_within_the_bound(monkeypatch):
    monkeypatch.setattr(kept_cells, "KEPT_CHARS", 1000)
    cell = KeptCell("e1")
    cell.apply("display_data", {"data": {"text/plain": "x" * 100}, "metadata": {}})
    for i in range(300):
        cell.apply("stream", {"name": "stdout", "text": f"line {i:03d}\n"})
    outputs = cell.as_message()["outputs"]
    assert [o["output_type"] for o in outputs] == ["stream"], "the oldest output went first"
    text = outputs[0]["text"]
    assert text.startswith(DROPPED) and text.endswith("line 299\n")
    assert len(text) <= 1000 and cell.chars == len(text)


def test_the_keeper_keeps_execute_requests_only_and_the_last_cells():
    session = Session()
    keeper = OutputKeeper(session, IOPUB)
    keeper.started(_request("e1"), execution_count=1)
    keeper.send(IOPUB, "stream", {"name": "stdout", "text": "hi\n"}, _request("e1"))
    keeper.send(IOPUB, "stream", {"name": "stdout", "text": "from a comm\n"},
                _request("x", kind="comm_msg"))
    keeper.send(SHELL, "execute_reply", {"status": "ok"}, _request("e1"))
    keeper.ended()
    keeper.send(IOPUB, "status", {"execution_state": "idle"}, _request("e1"))
    [cell] = keeper.cells()
    assert (cell["cell_id"], cell["session"], cell["execution_count"], cell["done"]) == (
        "c1", "page", 1, True)
    assert cell["outputs"] == [{"output_type": "stream", "name": "stdout", "text": "hi\n"}]
    assert cell["recent"] == ["m0", "m3"], "the ids of the messages it holds"
    for n in range(kept_cells.KEPT_CELLS + 5):
        keeper.send(IOPUB, "execute_input", {"execution_count": n}, _request(f"n{n}"))
    assert len(keeper.cells()) == kept_cells.KEPT_CELLS
    assert keeper.cells()[0]["msg_id"] == "n5", "the oldest went first"


def test_a_request_handled_beside_a_running_cell_is_followed_by_busy_again():
    session = Session()
    keeper = OutputKeeper(session, IOPUB)
    keeper.started(_request("e1"))
    keeper.send(IOPUB, "status", {"execution_state": "idle"},
                _request("k1", kind="kernel_info_request"))
    last = session.sent[-1][1]
    assert (last["content"], last["parent_header"]["msg_id"]) == (
        {"execution_state": "busy"}, "e1"), "busy again, for the running cell"
    keeper.ended()
    count = len(session.sent)
    keeper.send(IOPUB, "status", {"execution_state": "idle"},
                _request("k2", kind="kernel_info_request"))
    assert len(session.sent) == count + 1, "with no cell running, idle stays idle"


def test_the_page_gets_every_kept_cell_in_one_message():
    session = Session()
    keeper = OutputKeeper(session, IOPUB)
    keeper.started(_request("e1"))
    keeper.send(IOPUB, "stream", {"name": "stdout", "text": "hi\n"}, _request("e1"))

    class Comm:
        sent: list = []

        def send(self, data):
            self.sent.append(data)

    comm = Comm()
    keeper.open(comm, {})
    [message] = comm.sent
    assert [c["msg_id"] for c in message["cells"]] == ["e1"]
    assert not message["cells"][0]["done"]
