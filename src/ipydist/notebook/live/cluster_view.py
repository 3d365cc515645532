"""The live cluster view: ``%dist_status --live`` (and, collapsed, under ``%dist_start``), a
table of every rank that updates about once a second -- what it does (idle, running cell N,
waiting in a collective for T s, stopped at a breakpoint, dead, replaced), CPU %, memory, GPU
use and memory, last step time -- with buttons to interrupt, restart and stop.

:class:`ClusterMonitor` (one per session) keeps what the ranks last said: the cell loop hands
it each rank's vitals as they arrive (:mod:`ipydist.rank.vitals`: one message a second from a
running rank, no question asked of it) and the cell it runs. A thread of its own, running
only while a view is open, turns that into rows (:mod:`ipydist.notebook.live.cluster_state`)
every :data:`REFRESH_SECONDS` and sets them on every open view. Between cells, a rank on this
host is measured from here (psutil); one on another host shows what it said last. The thread
sends only widget state (comm messages, which ipykernel's IOPub thread carries from any
thread), never output, so nothing it sends can land under the wrong cell.

The buttons: **Interrupt** asks the Jupyter server to interrupt this kernel, as the
toolbar's stop button does (its REST call, made by the view in the page: a widget's message
would wait behind the running cell), and the cell's usual interrupt releases every rank;
**Restart** and **Stop** are messages to the kernel, shown only between cells.
"""

from __future__ import annotations

import os
import pathlib
import threading
import time
import uuid
from typing import TYPE_CHECKING

import anywidget
import traitlets

from ipydist.notebook.launch import processes
from ipydist.notebook.live.cluster_state import (
    FRESH_SECONDS,
    REPLACED_SECONDS,
    RunningCell,
    row,
)

if TYPE_CHECKING:
    from ipydist.session_face import SessionFace

_HERE = pathlib.Path(__file__).parent
#: How often the open views are refreshed.
REFRESH_SECONDS = 1.0
#: What a view (or the side panel) shows without a running cluster.
NO_CLUSTER = {"rows": [], "caption": "no cluster: %dist_start starts one", "busy": False,
              "stopped": True}
#: At most this many views are refreshed, the newest ones: an output cleared or a cell run
#: again does not close its widget, so old views would otherwise be refreshed for nothing.
MAX_VIEWS = 4


def kernel_id() -> str:
    """This kernel's id, as the Jupyter server knows it (its connection file is named after
    it), for the view's interrupt; empty outside a server's kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:
        return ""
    return name[len("kernel-"):-len(".json")] if name.startswith("kernel-") else ""


def show(view: ClusterView) -> None:
    """Display ``view``, and after it an empty output whose style hides the view's "model not
    found" box where the widget cannot render: a notebook reopened without its widget state
    (JupyterLab's and Notebook 7's default), where a live view has nothing to show anyway.
    The same rule as the metrics widget's static copy (:mod:`ipydist.notebook.live.static`)."""
    from IPython.display import display, publish_display_data

    key = uuid.uuid4().hex[:12]
    hide_error = (f".jp-OutputArea-child:has(+ .jp-OutputArea-child .ipydist-cluster-after-{key})"
                  ":not(:has(.ipydist-cluster)){display: none}")
    display(view)
    publish_display_data({"text/html": f'<div class="ipydist-cluster-after-{key}">'
                                       f"<style>{hide_error}</style></div>",
                          "text/plain": ""})


class ClusterView(anywidget.AnyWidget):
    _esm = _HERE / "cluster.js"
    _css = _HERE / "cluster.css"

    #: One dict per rank (see ``cluster_state.row``).
    rows: traitlets.List[dict] = traitlets.List().tag(sync=True)
    #: The line above the table: how many ranks, what runs, or that the cluster stopped.
    caption = traitlets.Unicode("").tag(sync=True)
    busy = traitlets.Bool(False).tag(sync=True)
    stopped = traitlets.Bool(False).tag(sync=True)
    collapsed = traitlets.Bool(False).tag(sync=True)
    kernel_id = traitlets.Unicode("").tag(sync=True)

    def __repr__(self) -> str:
        """The text/plain of the widget's output (a plain-text viewer, an untrusted page):
        what the view said when it was shown."""
        if not self.caption:
            return "ipydist live cluster view"
        ranks = "; ".join(f"rank {r.get('rank')} {r.get('host', '')} {r.get('state', '')}"
                          for r in self.rows)
        return f"ipydist live cluster view: {self.caption}" + (f" ({ranks})" if ranks else "")


class ClusterMonitor:
    """What the open cluster views show, for one session (see the module docstring)."""

    def __init__(self, session: SessionFace) -> None:
        self.session = session
        self._lock = threading.RLock()  # the views' thread and the side panel's
        self._vitals: dict[int, tuple[float, dict]] = {}  # rank -> (monotonic, vitals)
        self._usage: dict[int, tuple[float, float]] = {}  # rank -> (monotonic, cpu seconds)
        self._pids: dict[int, object] = {}
        self._replaced: dict[int, float] = {}
        self.cell: RunningCell | None = None
        self._views: list[ClusterView] = []
        self._thread: threading.Thread | None = None

    # --- fed by the cell loop (the notebook's main thread) -----------------------------------

    def cell_started(self, number: int | None, ranks: list[int]) -> None:
        self.cell = RunningCell(number, list(ranks))
        self._vitals.clear()

    def cell_ended(self) -> None:
        self.cell = None
        self._vitals.clear()

    def accept(self, rank: int, vitals: dict) -> None:
        self._vitals[rank] = (time.monotonic(), vitals)

    # --- views ---------------------------------------------------------------------------------

    def open_view(self, collapsed: bool = False) -> ClusterView:
        """A new view of this session's cluster, refreshed while it is open."""
        view = ClusterView(collapsed=collapsed, kernel_id=kernel_id())
        view.on_msg(self._on_click)
        self._refresh([view])
        self._views = [*self._open_views(), view]
        while len(self._views) > MAX_VIEWS:
            old = self._views.pop(0)
            old.caption += " · no longer updated: a newer view is open"
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ipydist-cluster-view",
                                            daemon=True)
            self._thread.start()
        return view

    def _run(self) -> None:
        while True:
            time.sleep(REFRESH_SECONDS)
            views = self._open_views()
            if not views:
                return  # opened again with the next view
            try:
                self._refresh(views)
            except Exception:  # a cluster stopping under it: the next refresh says so
                pass

    def _refresh(self, views) -> None:
        with self._lock:
            state = self.snapshot()
            for view in views:
                with view.hold_sync():
                    for name, value in state.items():
                        if getattr(view, name) != value:
                            setattr(view, name, value)

    def snapshot(self) -> dict:
        """The views' traits now: ``rows``, ``caption``, ``busy``, ``stopped``."""
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict:
        session = self.session
        cluster = session.cluster
        if cluster is None or not session.running:
            return dict(NO_CLUSTER)
        now = time.monotonic()
        cell = self.cell
        rows = []
        for info in list(cluster.ranks):
            rank = info.rank
            alive, proc = cluster.rank_state(rank)
            self._note_replacement(rank, info.pid, now)
            seen = self._vitals.get(rank)
            fresh = seen[1] if seen and now - seen[0] <= FRESH_SECONDS else None
            usage = self._usage_of(rank, proc, now) if alive != "dead" else None
            replaced = now - self._replaced.get(rank, -REPLACED_SECONDS) < REPLACED_SECONDS
            rows.append(row(info, alive, fresh, usage, cell, replaced))
        what = (f"running cell {cell.number}" if cell and cell.number is not None
                else "running a cell" if cell else "idle")
        heal = session.healing
        if heal is not None and not heal.done:  # where the heal is: the copy's MB of how many
            what = heal.describe().rstrip(".")
        hosts = len({r["host"] for r in rows})
        where = f" on {hosts} hosts" if hosts > 1 else ""
        return {"rows": rows, "caption": f"{len(rows)} ranks{where} · {what}",
                "busy": cell is not None, "stopped": False}

    def _note_replacement(self, rank: int, pid, now: float) -> None:
        known = self._pids.get(rank)
        if known is not None and known != pid:
            self._replaced[rank] = now
        self._pids[rank] = pid

    def _usage_of(self, rank: int, proc, now: float) -> dict | None:
        """CPU % and RSS of a rank on this host, measured here (None for another host's)."""
        if proc is None:
            return None
        try:
            times = proc.cpu_times()
        except Exception:
            return None
        rss = processes.resident_bytes(proc)
        cpu_seconds = times.user + times.system
        last = self._usage.get(rank)
        self._usage[rank] = (now, cpu_seconds)
        cpu = None if last is None else 100.0 * (cpu_seconds - last[1]) / max(now - last[0],
                                                                                1e-6)
        return {"cpu": cpu, "rss": rss}

    # --- buttons -------------------------------------------------------------------------------

    def _on_click(self, view, content, buffers) -> None:
        """Restart and Stop, from a view (the view shows them only between cells)."""
        self.act(content.get("action") if isinstance(content, dict) else None)
        self._refresh(self._open_views())

    def act(self, action: str | None) -> None:
        """A view's or the side panel's ``"stop"`` or ``"restart"``."""
        session = self.session
        if action == "stop" and session.running:
            session.stop()
        elif action == "restart":
            session.restart()

    def _open_views(self) -> list[ClusterView]:
        return [v for v in list(self._views) if v.comm is not None]

