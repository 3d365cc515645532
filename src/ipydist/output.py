"""What the ranks print, brought into the notebook live and tagged by rank.

Two parts. :class:`OutputCollector` hooks into ipyparallel's IOPub dispatch for one cell and
turns each rank's messages into events on a queue, losing none and showing none twice.
:class:`LineMerger` is pure logic: it buffers each rank's lines for a moment so that a line
every rank prints (``epoch 3 done``) is shown once as ``[all ranks]`` instead of N times.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ipyparallel.serialize import deserialize_object

from ipydist.live.batching import DATA_KEY
from ipydist.stall import STATE_KEY

#: Data-message keys the ranks send, and the kind of event each becomes.
_DATA_EVENTS = {DATA_KEY: "metrics", STATE_KEY: "state"}

ALL = "all ranks"


@dataclass
class Event:
    rank: int
    # "stdout" | "stderr" | "display_data" | "execute_result" | "metrics" | "state"
    kind: str
    content: Any


class OutputCollector:
    """Collects one cell's IOPub output from every rank into a thread-safe queue.

    Output can reach the client's IO thread before our callbacks are attached (the request is
    sent from that thread as soon as ``execute`` returns). ipyparallel keeps everything that
    arrived in the request's metadata, so each rank starts with a snapshot of it: taken on the
    first callback (the metadata then already includes that message), or at :meth:`finish` if
    no message came after attaching. A lock makes sure exactly one of the two takes it, so no
    output is lost or shown twice, and no extra wake-up of the IO thread is needed. (Metrics
    batches are the exception: the metadata keeps only the latest one, which the snapshot
    includes; batches are numbered, so the history ignores it if it comes twice.)
    """

    def __init__(self, async_result, ranks: list[int]):
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started: set[int] = set()
        self._futures = dict(zip(ranks, async_result._children))
        self._callbacks = []
        for rank, future in self._futures.items():
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
        # the latest metrics batch (a repeat is ignored by the history) and the latest state
        for key, kind in _DATA_EVENTS.items():
            value = (md.get("data") or {}).get(key)
            if value is not None:
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
                    if key not in _DATA_EVENTS:
                        continue
                    value = data.get(key)
                    if value is None:
                        value = deserialize_object(msg["buffers"])[0][key]
                    self.events.put(Event(rank, _DATA_EVENTS[key], value))

        return on_iopub

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


class LineMerger:
    """Buffers each rank's stream text and releases tagged lines.

    A complete line that is at the head of every rank's buffer, and identical on all of them,
    is released once with the tag ``"all ranks"``. Any other line is released with its rank's
    tag once it has waited ``hold`` seconds (or at :meth:`flush`), so nothing is held back long.
    """

    def __init__(self, ranks: list[int], hold: float = 0.25):
        self.ranks = list(ranks)
        self.hold = hold
        self._partial: dict[tuple[int, str], str] = {}
        self._lines: dict[tuple[int, str], deque[tuple[float, str]]] = {
            (r, s): deque() for r in self.ranks for s in ("stdout", "stderr")
        }

    def feed(self, rank: int, stream: str, text: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        *complete, rest = text.split("\n")
        for line in complete:
            self._lines[key].append((now, line + "\n"))
        if rest:
            self._partial[key] = rest

    def release(self, now: float | None = None) -> list[tuple[str, str, str]]:
        """Lines ready to show now, as (tag, stream, line)."""
        now = time.monotonic() if now is None else now
        out: list[tuple[str, str, str]] = []
        for stream in ("stdout", "stderr"):
            queues = [self._lines[(r, stream)] for r in self.ranks]
            while True:
                if len(self.ranks) > 1 and all(queues):
                    heads = {q[0][1] for q in queues}
                    if len(heads) == 1:
                        out.append((ALL, stream, queues[0][0][1]))
                        for q in queues:
                            q.popleft()
                        continue
                released = False
                for r, q in zip(self.ranks, queues):
                    if q and now - q[0][0] >= self.hold:
                        out.append((f"rank {r}", stream, q.popleft()[1]))
                        released = True
                if not released:
                    break
        return out

    def flush(self) -> list[tuple[str, str, str]]:
        """Everything still buffered, partial lines included (the cell has ended)."""
        for key, rest in list(self._partial.items()):
            self._lines[key].append((float("-inf"), rest + "\n"))
        self._partial.clear()
        return self.release(now=float("inf"))
