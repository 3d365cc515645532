"""The kernel's side of ipydist's JupyterLab side panel (the labextension, ``labextension/``
in the repository, shipped prebuilt in the wheel): a comm target, ``ipydist.cluster``, that
the panel opens on the current notebook's kernel; each open comm gets the live cluster view's
state (:meth:`ClusterMonitor.snapshot`) once a second when it changed, and the panel's Restart
and Stop come back on it. Interrupt is JupyterLab's own kernel interrupt, sent by the panel.

The panel may open before any cluster, and a cluster may stop and start again under it, so
the feed asks the magics for their session at every refresh. JupyterLab sends a comm's
messages on a subshell of the kernel where there are subshells (ipykernel 7): the panel's
comm then opens, and its messages arrive, in that subshell's thread, while a cell runs in the
main one; elsewhere they wait for the cell to end.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ipydist.notebook.live.cluster_view import NO_CLUSTER, REFRESH_SECONDS

if TYPE_CHECKING:
    from comm.base_comm import CommManager

    from ipydist.session_face import MagicsFace

#: The comm target the panel opens.
TARGET = "ipydist.cluster"


class PanelFeed:
    """Every open panel of this kernel, fed from one thread."""

    def __init__(self, magics: MagicsFace) -> None:
        self.magics = magics
        self._comms: list = []
        self._last: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def open(self, comm, msg) -> None:
        """A panel opened a comm (the comm manager calls this)."""
        comm.on_msg(lambda msg: self._on_msg(msg))
        comm.on_close(lambda msg: self._forget(comm))
        with self._lock:
            self._comms.append(comm)
        self._send(comm, self.state())
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ipydist-panel",
                                            daemon=True)
            self._thread.start()

    def state(self) -> dict:
        session = self.magics.session
        if session is None:
            return dict(NO_CLUSTER)
        return session.monitor.snapshot()

    def _run(self) -> None:
        while True:
            time.sleep(REFRESH_SECONDS)
            with self._lock:
                comms = list(self._comms)
            if not comms:
                return
            try:
                state = self.state()
            except Exception:  # a cluster stopping under it: the next refresh says so
                continue
            for comm in comms:
                if self._last.get(comm.comm_id) != state:
                    self._send(comm, state)

    def _send(self, comm, state: dict) -> None:
        self._last[comm.comm_id] = state
        try:
            comm.send({"state": state})
        except Exception:
            self._forget(comm)

    def _forget(self, comm) -> None:
        with self._lock:
            if comm in self._comms:
                self._comms.remove(comm)
        # a comm without an id was never stored: pop finds nothing
        self._last.pop(getattr(comm, "comm_id", None), None)  # type: ignore[arg-type]

    def _on_msg(self, msg) -> None:
        """Restart or Stop from a panel."""
        action = (msg.get("content", {}).get("data") or {}).get("action")
        if self.magics.session is not None:
            self.magics.session.monitor.act(action)


#: The feed of each kernel's panels, by the kernel's id (``%reload_ext`` registers again).
_FEEDS: dict[int, PanelFeed] = {}


def register(shell, magics: MagicsFace) -> PanelFeed | None:
    """Let panels open ``TARGET`` on ``shell``'s kernel (none outside a kernel); once per
    kernel: a second call (``%reload_ext ipydist``) hands the first feed the new magics."""
    if getattr(shell, "kernel", None) is None:
        return None
    if (feed := _FEEDS.get(id(shell.kernel))) is not None:
        feed.magics = magics
        return feed
    manager: CommManager | None  # comm's, or the kernel's own (ipykernel's subclass)
    try:
        from comm import get_comm_manager

        manager = get_comm_manager()
    except Exception:
        manager = getattr(shell.kernel, "comm_manager", None)
    if manager is None:
        return None
    feed = _FEEDS[id(shell.kernel)] = PanelFeed(magics)
    manager.register_target(TARGET, feed.open)
    return feed
