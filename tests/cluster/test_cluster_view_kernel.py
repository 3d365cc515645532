"""The live cluster view through a real Jupyter kernel (jupyter_client, the widget's comm
messages as a front end receives them): ``%dist_start`` shows it collapsed, ``%dist_status
--live`` open; while a cell runs its rows say which rank runs the cell and which wait in a
collective, with their CPU and memory; after the cell they are idle again; its Stop button
stops the cluster."""

from __future__ import annotations

import time
import uuid

import pytest
from jupyter_client.manager import start_new_kernel

WAITS_FOR_RANK_3 = """%%everyrank
import time, torch, ipydist.torch as hvd
if hvd.rank() == 3:
    time.sleep(5)
torch.distributed.all_reduce(torch.ones(1))"""


class Views:
    """Every cluster view's state, kept up to date from the kernel's IOPub messages."""

    def __init__(self, kc):
        self.kc = kc
        self.state: dict[str, dict] = {}  # comm id -> the view's traits
        self.history: list[tuple[str, dict]] = []  # (comm id, state) after each update

    def pump(self, seconds: float, until=None) -> dict[str, dict]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if until is not None and until():
                break
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except Exception:
                continue
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "comm_open":
                state = content["data"].get("state", {})
                if "rows" in state and "kernel_id" in state:
                    self.state[content["comm_id"]] = dict(state)
            elif kind == "comm_msg" and content["comm_id"] in self.state:
                data = content["data"]
                if data.get("method") == "update":
                    self.state[content["comm_id"]].update(data.get("state", {}))
                    self.history.append((content["comm_id"],
                                         dict(self.state[content["comm_id"]])))
        return self.state


def run(kc, code: str) -> dict:
    msg_id = kc.execute(code)
    while True:
        reply = kc.get_shell_msg(timeout=180)
        if reply["parent_header"].get("msg_id") == msg_id:
            assert reply["content"]["status"] == "ok", (code, reply["content"])
            return reply


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def test_the_view_follows_a_cell_and_stops_the_cluster(kernel):
    km, kc = kernel
    views = Views(kc)
    run(kc, "%load_ext ipydist\n%dist_start --np 4")
    views.pump(2)
    assert [s["collapsed"] for s in views.state.values()] == [True], "under the start, closed"
    run(kc, "%dist_status --live")
    views.pump(2)
    live = [cid for cid, s in views.state.items() if not s["collapsed"]]
    assert len(live) == 1, views.state
    live = live[0]
    rows = views.state[live]["rows"]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3] and {r["state"] for r in rows} == {"idle"}
    assert all(r["memory"].endswith("MiB") for r in rows), rows

    cell = kc.execute(WAITS_FOR_RANK_3)

    def seen_waiting():  # each rank's vitals come on their own second: wait for all three
        return any(cid == live and _waiting(s, 3) for cid, s in views.history)

    views.pump(60, until=seen_waiting)
    assert seen_waiting(), views.history[-3:]
    during = next(s for cid, s in views.history if cid == live and _waiting(s, 3))
    states = {r["rank"]: r["state"] for r in during["rows"]}
    assert states[3].startswith("running cell"), states
    assert all(states[r].startswith("waiting in all_reduce for") for r in (0, 1, 2)), states
    assert during["busy"] and "running cell" in during["caption"], during
    assert all(r["cpu"].endswith("%") for r in during["rows"]), during["rows"]
    while kc.get_shell_msg(timeout=120)["parent_header"].get("msg_id") != cell:
        pass
    views.pump(4, until=lambda: not views.state[live]["busy"])
    assert {r["state"] for r in views.state[live]["rows"]} == {"idle"}, views.state[live]

    # the Stop button: a message from the view, as its click sends it
    request = kc.session.msg("comm_msg", {"comm_id": live, "data": {
        "method": "custom", "content": {"action": "stop"}}})
    kc.shell_channel.send(request)
    views.pump(30, until=lambda: views.state[live]["stopped"])
    assert views.state[live]["stopped"] and views.state[live]["rows"] == [], views.state[live]
    run(kc, "import ipydist\nassert not get_ipython().magics_manager.registry"
            "['DistMagics'].session.running")


def _waiting(state: dict, ranks: int = 1) -> bool:
    """Whether at least ``ranks`` ranks are shown waiting in a collective."""
    return sum(r["state"].startswith("waiting in") for r in state["rows"]) >= ranks


def test_the_side_panels_comm_follows_the_cluster(kernel):
    """JupyterLab's ipydist panel opens a comm to ``ipydist.cluster`` (as the labextension
    does): it gets the view's state, follows a cluster started after it opened, and its Stop
    stops the cluster."""
    km, kc = kernel
    run(kc, "%load_ext ipydist")  # loaded already: nothing twice
    comm_id = uuid.uuid4().hex
    kc.shell_channel.send(kc.session.msg("comm_open", {
        "comm_id": comm_id, "target_name": "ipydist.cluster", "data": {}}))
    states = []

    def pump(seconds, until):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except Exception:
                continue
            if (msg["header"]["msg_type"] == "comm_msg"
                    and msg["content"]["comm_id"] == comm_id):
                states.append(msg["content"]["data"]["state"])

    pump(20, lambda: states)
    assert states and states[-1]["stopped"] and states[-1]["rows"] == [], states
    run(kc, "%dist_start --np 2")
    pump(20, lambda: states[-1]["rows"])
    assert [r["rank"] for r in states[-1]["rows"]] == [0, 1], states[-1]
    assert not states[-1]["stopped"] and states[-1]["caption"].startswith("2 ranks")
    kc.shell_channel.send(kc.session.msg("comm_msg", {
        "comm_id": comm_id, "data": {"action": "stop"}}))
    pump(30, lambda: states[-1]["stopped"])
    assert states[-1]["stopped"], states[-1]
    kc.shell_channel.send(kc.session.msg("comm_close", {"comm_id": comm_id, "data": {}}))
