"""A second page on a kernel whose cell runs, as jupyter_client sends it what JupyterLab sends
as it opens a notebook: with ipydist loaded, ``kernel_info`` and ``comm_info`` are answered at
once (not when the cell ends), a widget's ``request_state`` too (with or without a subshell),
the status said after them is "busy" again, and ``ipydist.kept_cells`` gives the running cell's
output so far and the cells before. No ranks: this is the kernel's part alone."""

from __future__ import annotations

import queue
import time
import uuid

import pytest
from jupyter_client.manager import start_new_kernel
from jupyter_client.session import Session

#: Prints, updates a display, shows a widget, then runs on for a while.
RUNNING = """import time, ipywidgets
from IPython.display import display
print("line 1", flush=True)
bar = display({"text/plain": "0 %"}, raw=True, display_id=True)
slider = ipywidgets.IntSlider(3)
display(slider)
bar.update({"text/plain": "100 %"}, raw=True)
print("line 2", flush=True)
time.sleep(SECONDS)
print("after")"""
#: How long the cell runs on: every answer below must come well before.
RUNS = 8
QUICK = 2.5


@pytest.fixture
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    # a session of its own, as a second page has (one Session object between two clients
    # takes each IOPub message the first deserializes as a replay for the second)
    page = km.client(session=Session(key=km.session.key,
                                      signature_scheme=km.session.signature_scheme))
    page.start_channels()
    try:
        yield km, kc, page
    finally:
        page.stop_channels()
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def _reply(client, msg, channel="shell", timeout=QUICK) -> tuple[dict, float]:
    start = time.monotonic()
    getattr(client, f"{channel}_channel").send(msg)
    while True:
        reply = getattr(client, f"get_{channel}_msg")(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply, time.monotonic() - start


def _iopub_until(client, check, timeout=QUICK) -> list[dict]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = client.get_iopub_msg(timeout=0.1)
        except queue.Empty:
            continue
        seen.append(msg)
        if check(msg):
            return seen
    pytest.fail(f"not on IOPub within {timeout} s; seen: "
                f"{[(m['msg_type'], m['content']) for m in seen][-10:]}")


def _kept(page) -> list[dict]:
    # opened on a subshell, as JupyterLab opens a comm on a kernel that has them
    subshell, _ = _reply(page, page.session.msg("create_subshell_request", {}), "control")
    comm_id = uuid.uuid4().hex
    msg = page.session.msg("comm_open", {"comm_id": comm_id,
                                         "target_name": "ipydist.kept_cells", "data": {}})
    msg["header"]["subshell_id"] = subshell["content"]["subshell_id"]
    page.shell_channel.send(msg)

    def reply(m) -> bool:
        return m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == comm_id

    [reply] = [m for m in _iopub_until(page, reply) if reply(m)]
    return reply["content"]["data"]["cells"]


def test_a_page_that_opens_while_a_cell_runs_is_answered_and_caught_up(kernel):
    km, kc, page = kernel
    kc.execute_interactive("%load_ext ipydist", timeout=60)
    running = kc.execute(RUNNING.replace("SECONDS", str(RUNS)))
    _iopub_until(kc, lambda m: m["msg_type"] == "stream" and "line 2" in m["content"]["text"],
                 timeout=30)
    cell_started = time.monotonic()

    info, took = _reply(page, page.session.msg("kernel_info_request", {}))
    assert info["content"]["status"] == "ok" and took < QUICK
    assert info["content"]["ipydist_kept_cells"] is True
    comms, took = _reply(page, page.session.msg("comm_info_request",
                                                {"target_name": "jupyter.widget"}))
    widgets = list(comms["content"]["comms"])
    assert widgets and took < QUICK, comms["content"]
    # the page's first comm message names no subshell (JupyterLab's, before its subshell exists)
    request = page.session.msg("comm_msg", {"comm_id": widgets[0],
                                            "data": {"method": "request_state"}})
    page.shell_channel.send(request)
    _iopub_until(page, lambda m: m["msg_type"] == "comm_msg"
                 and m["content"]["data"].get("method") == "update")
    seen = _iopub_until(page, lambda m: m["msg_type"] == "status"
                        and m["parent_header"].get("msg_id") == running)
    assert seen[-1]["content"]["execution_state"] == "busy", "busy again, for the cell"

    cells = _kept(page)
    assert time.monotonic() - cell_started < RUNS, "all of it while the cell ran"
    load, cell = cells
    assert load["done"] and load["execution_count"] == 1
    assert cell["msg_id"] == running and not cell["done"]
    kinds = [o["output_type"] for o in cell["outputs"]]
    assert kinds == ["stream", "display_data", "display_data", "stream"], cell["outputs"]
    assert cell["outputs"][0]["text"] == "line 1\n"
    assert cell["outputs"][1]["data"]["text/plain"] == "100 %", "the update applied"
    assert "application/vnd.jupyter.widget-view+json" in cell["outputs"][2]["data"]

    reply = kc.get_shell_msg(timeout=RUNS + 30)
    assert reply["parent_header"]["msg_id"] == running
    time.sleep(0.5)
    done = _kept(page)[-1]
    assert done["done"] and done["execution_count"] == 2
    assert done["outputs"][-1] == {"output_type": "stream", "name": "stdout",
                                   "text": "line 2\nafter\n"}


def test_without_ipydist_the_page_waits_for_the_cell(kernel):
    """The control: what the first test measures is ipydist's doing."""
    km, kc, page = kernel
    kc.execute(RUNNING.replace("SECONDS", "4"))
    _iopub_until(kc, lambda m: m["msg_type"] == "stream" and "line 2" in m["content"]["text"],
                 timeout=30)
    with pytest.raises(queue.Empty):
        _reply(page, page.session.msg("kernel_info_request", {}), timeout=1.5)
