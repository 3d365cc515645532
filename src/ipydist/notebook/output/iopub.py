"""Everything the ranks send during one cell, as events on a queue, tagged by rank.

:class:`IOPubCollector` hooks into ipyparallel's IOPub dispatch for one cell and turns each
rank's messages -- printed text, rich output, its last value, and the data messages of
:mod:`ipydist.protocol` (metric batches, collective waits) -- into :class:`Event` objects,
losing none and showing none twice. The cell loop (:mod:`ipydist.notebook.cell`) drains them.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ipyparallel.serialize import deserialize_object

from ipydist.protocol import CELL_KEY, DEBUG_KEY, STATE_KEY, VITALS_KEY, is_metrics_key

if TYPE_CHECKING:
    from collections.abc import Callable

#: Data-message keys the ranks send, and the kind of event each becomes (besides the metrics
#: batches, each under its own key: see :data:`ipydist.protocol.METRICS_KEY`).
_DATA_EVENTS = {STATE_KEY: "state", CELL_KEY: "cell", DEBUG_KEY: "debug",
                VITALS_KEY: "vitals"}


def _data_kind(key: str) -> str | None:
    return "metrics" if is_metrics_key(key) else _DATA_EVENTS.get(key)


@dataclass
class Event:
    rank: int
    # "stdout" | "stderr" | "display_data" | "execute_result" | "metrics" | "state" | "cell"
    # | "debug" | "vitals"
    kind: str
    content: Any


class _Events(queue.SimpleQueue):
    """The queue, but events of the kinds in ``direct`` go to their function at once, in the
    thread that received them: the rank's vitals reach the cluster view while the notebook's
    main thread waits for a person at a breakpoint's prompt, when nothing reads the queue."""

    def __init__(self, direct: dict[str, Callable[[int, Any], None]]) -> None:
        super().__init__()
        self.direct = direct

    def put(self, item: Event, block: bool = True, timeout: float | None = None) -> None:
        if (to := self.direct.get(item.kind)) is not None:
            to(item.rank, item.content)
        else:
            super().put(item, block, timeout)


class IOPubCollector:
    """Collects one cell's IOPub output from every rank into a thread-safe queue.

    Its callbacks are attached to each rank's request before the request is sent
    (:func:`ipydist.notebook.ipp.execute` calls :meth:`watch`), so they see every message, in
    the order the rank sent it: a display and the lines printed around it keep their order.
    ipyparallel also keeps everything that arrived in the request's metadata, and each rank
    starts with a snapshot of it: taken on the first callback (the metadata then holds that
    one message), or at :meth:`finish` if none came. A lock makes sure exactly one of the two
    takes it, so no output is lost or shown twice. (Metrics batches have each their own key
    in the metadata, taken out of it as it is queued, so none is kept twice in memory; one may
    be queued twice, by the snapshot and by its own message, and the history ignores the
    repeat by its number.)
    """

    def __init__(self, ranks: list[int],
                 direct: dict[str, Callable[[int, Any], None]] | None = None):
        self.events: _Events = _Events(direct or {})
        self._lock = threading.Lock()
        self._started: set[int] = set()
        self._ranks = ranks
        self._futures: dict = {}
        self._callbacks: list[tuple[Any, Callable[[dict], None]]] = []  # (future, callback)

    def watch(self, index: int, future) -> None:
        """Attach to the request future of ``ranks[index]`` (:func:`ipp.execute` calls this
        before the request is sent, so the callback sees every message, in order)."""
        rank = self._ranks[index]
        self._futures[rank] = future
        callback = self._make_callback(rank, future)
        future.iopub_callbacks.append(callback)
        self._callbacks.append((future, callback))

    def _snapshot(self, rank: int, future) -> bool:
        """Queue what arrived so far for ``rank``, once; False if that was already done."""
        with self._lock:
            if rank in self._started:
                return False
            self._started.add(rank)
        md = future.output.metadata
        for name in ("stdout", "stderr"):
            if md[name]:
                self.events.put(Event(rank, name, md[name]))
        for output in list(md["outputs"]):
            self.events.put(Event(rank, "display_data", output))
        if md["execute_result"]:
            self.events.put(Event(rank, "execute_result", md["execute_result"]))
        # every metrics batch not taken yet, and the latest state of the rank and its cell
        data = md.get("data") or {}
        for key in list(data):
            kind = _data_kind(key)
            if kind == "metrics":
                value = data.pop(key, None)
            elif kind is not None:
                value = data.get(key)
            if kind is not None and value is not None:
                self.events.put(Event(rank, kind, value))
        return True

    def _make_callback(self, rank: int, future):
        def on_iopub(msg):
            kind = msg["header"]["msg_type"]
            content = msg["content"]
            if self._snapshot(rank, future) and kind != "data_message":
                return  # the snapshot already holds this message
            if kind == "stream":
                self.events.put(Event(rank, content["name"], content["text"]))
            elif kind in ("display_data", "execute_result"):
                self.events.put(Event(rank, kind, content))
            elif kind == "data_message":
                # ipyparallel has just unpacked this message into the metadata (callbacks run
                # after it): take it from there rather than unpack a large batch twice.
                data = future.output.metadata.get("data") or {}
                for key in content.get("keys", ()):
                    kind = _data_kind(key)
                    if kind is None:
                        continue
                    # a batch leaves the metadata once queued (the snapshot may have taken it)
                    value = data.pop(key, None) if kind == "metrics" else data.get(key)
                    if value is None and kind != "metrics":
                        value = deserialize_object(msg["buffers"])[0][key]
                    if value is not None:
                        self.events.put(Event(rank, kind, value))

        return on_iopub

    def cell_state(self, rank: int) -> str | None:
        """What ``rank`` last said of the cell ("started", "ended" or None), read straight
        from what ipyparallel has received (an event may not have been queued yet)."""
        return (self._futures[rank].output.metadata.get("data") or {}).get(CELL_KEY)

    def drain(self) -> list[Event]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def finish(self) -> None:
        """Detach; call once every rank's output is complete (or the cell was abandoned)."""
        for future, callback in self._callbacks:
            try:
                future.iopub_callbacks.remove(callback)
            except ValueError:
                pass
        for rank, future in self._futures.items():
            self._snapshot(rank, future)
