"""The output of the last cells, kept in the kernel for a page that was not there to see it.

A Jupyter kernel sends a cell's output once, to the pages connected at that moment; JupyterLab
keeps it only in the page's model (jupyterlab#2833). A person who closes the laptop during
training and opens the notebook again finds no output at all, or what the last save held:
the cell's rank lines, progress and chart are gone, and the cell does not even show as
running. JupyterLab's own remedy (jupyter-server-nbmodel: the server runs the cell and writes
its output into the document) needs the collaboration extension and changes how every cell
runs; this works in a plain JupyterLab, for every cell, ipydist's or not.

:class:`OutputKeeper` sees every message the kernel's session sends (the one place all output
passes, whichever thread sends it: the main thread's displays, the IOPub thread's streams, a
subshell's comm replies) and keeps, per execute request, the outputs the notebook would save:
streams joined as JupyterLab joins them, displays updated in place by their display id,
``clear_output`` applied. It is bounded (:data:`KEPT_CELLS` cells, :data:`KEPT_CHARS` of text
and data each, the oldest output dropped first) and costs a dict lookup per message.

A page asks for the kept cells on the comm target :data:`TARGET` (the labextension's catch-up
plugin does, when the kernel's ``kernel_info`` reply says there are some:
:mod:`~ipydist.notebook.reopen.busy_shell`) and gets them in one message. The page then shows
each cell it did not run itself as it would have, with the cell running (``[*]``) where it
still runs, and applies the output that follows from IOPub. The reply and the output share one
lock, and the reply names the last messages it includes, so output that crosses it on the way
is neither lost nor shown twice.
"""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass, field

from ipydist.notebook.output import display

#: The comm target a page opens to get the kept cells.
TARGET = "ipydist.kept_cells"
#: How many cells are kept (the last ones run).
KEPT_CELLS = 30
#: About how many characters of output a cell keeps (text, and each display's data); beyond,
#: its oldest outputs are dropped, and a stream keeps its end.
KEPT_CHARS = 4_000_000
#: How many of a cell's last message ids a reply names (those that may still be on the way).
RECENT = 256
#: The output messages kept, as Jupyter's messaging spec names them.
OUTPUT_TYPES = frozenset({"stream", "display_data", "update_display_data", "execute_result",
                          "error", "clear_output", "execute_input", "status"})
#: Set to 0 in the kernel's environment, nothing is kept (and a page that opens the notebook
#: again finds what the last save holds, as without ipydist).
OFF_VARIABLE = "IPYDIST_KEEP_OUTPUT"
#: Put where a stream's beginning was dropped.
DROPPED = "[ipydist: the beginning of this output was not kept]\n"


@dataclass
class KeptCell:
    """One execute request's output, as nbformat outputs."""

    msg_id: str
    session: str = ""
    cell_id: str | None = None
    execution_count: int | None = None
    done: bool = False
    #: [display id or None, output] in order
    outputs: list[list] = field(default_factory=list)
    chars: int = 0
    clear_next: bool = False
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT))

    def apply(self, kind: str, content: dict) -> None:
        if kind == "execute_input":
            self.execution_count = content.get("execution_count")
            return
        if kind == "status":
            self.done = self.done or content.get("execution_state") == "idle"
            return
        if kind == "clear_output":
            if content.get("wait"):
                self.clear_next = True
            else:
                self._clear()
            return
        if kind == "update_display_data":
            display_id = (content.get("transient") or {}).get("display_id")
            for item in self.outputs:
                if item[0] == display_id and display_id is not None:
                    self.chars += _chars(content) - _chars(item[1])
                    item[1] = {**item[1], "data": content.get("data", {}),
                               "metadata": content.get("metadata", {})}
            self._trim()
            return
        if self.clear_next:
            self._clear()
        output = _output(kind, content)
        if output is None:
            return
        last = self.outputs[-1][1] if self.outputs else None
        if (kind == "stream" and last is not None and last["output_type"] == "stream"
                and last["name"] == output["name"]):
            last["text"] += output["text"]
        else:
            display_id = (content.get("transient") or {}).get("display_id")
            self.outputs.append([display_id, output])
        self.chars += _chars(output)
        self._trim()

    def _clear(self) -> None:
        self.outputs.clear()
        self.chars = 0
        self.clear_next = False

    def _trim(self) -> None:
        while self.chars > KEPT_CHARS and self.outputs:
            first = self.outputs[0][1]
            if len(self.outputs) == 1 and first["output_type"] == "stream":
                over = self.chars - KEPT_CHARS + len(DROPPED)
                first["text"] = DROPPED + first["text"][over:]
                self.chars = _chars(first)
                return
            self.chars -= _chars(first)
            self.outputs.pop(0)

    def as_message(self) -> dict:
        display_ids: dict[str, list[int]] = {}  # display id -> the indices of its outputs
        for i, (display_id, _) in enumerate(self.outputs):
            if display_id is not None:
                display_ids.setdefault(display_id, []).append(i)
        return {"msg_id": self.msg_id, "session": self.session, "cell_id": self.cell_id,
                "execution_count": self.execution_count, "done": self.done,
                "outputs": [output for _, output in self.outputs],
                "display_ids": display_ids, "recent": list(self.recent)}


def _chars(output: dict) -> int:
    if output.get("output_type") == "stream":
        return len(output["text"])
    data = output.get("data") or {}
    return sum(len(v) if isinstance(v, str) else 64 for v in data.values()) + 64


def _output(kind: str, content: dict) -> dict | None:
    """An nbformat v4 output from an IOPub message's content (as nbformat's output_from_msg,
    which the kernel does not import)."""
    if kind == "stream":
        return {"output_type": "stream", "name": content.get("name", "stdout"),
                "text": content.get("text", "")}
    if kind == "display_data":
        return {"output_type": "display_data", "data": content.get("data", {}),
                "metadata": content.get("metadata", {})}
    if kind == "execute_result":
        return {"output_type": "execute_result", "data": content.get("data", {}),
                "metadata": content.get("metadata", {}),
                "execution_count": content.get("execution_count")}
    if kind == "error":
        return {"output_type": "error", "ename": content.get("ename", ""),
                "evalue": content.get("evalue", ""), "traceback": content.get("traceback", [])}
    return None


class OutputKeeper:
    """Every execute request's output, from the session's messages (see the module docstring)."""

    def __init__(self, session, iopub) -> None:
        self.session = session
        # IOPub as the kernel's displays and comms name it, and as its streams do (the thread)
        self._iopub = (iopub, getattr(iopub, "io_thread", iopub))
        self._send = session.send  # the session's own
        self._lock = threading.RLock()
        self._cells: collections.OrderedDict[str, KeptCell] = collections.OrderedDict()
        self._running: dict | None = None  # the header of the request the main shell runs
        #: Off, ``send`` is the session's own but for a test (benchmarks/kept_output.py).
        self.enabled = True

    def send(self, stream, msg_or_type, content=None, parent=None, *args, **kwargs):
        """The session's ``send``, keeping what an execute request outputs.

        While a cell runs, a request handled beside it (on a subshell, or by
        :mod:`~ipydist.notebook.reopen.busy_shell`) ends with its own "idle" status, which a
        page's status bar reads as the kernel's: the kernel says "busy" again after it, on
        behalf of the running cell."""
        if not self.enabled:
            return self._send(stream, msg_or_type, content, parent, *args, **kwargs)
        with self._lock:
            msg = self._send(stream, msg_or_type, content, parent, *args, **kwargs)
            if (stream is self._iopub[0] or stream is self._iopub[1]) and isinstance(msg, dict):
                self._keep(msg)
                running = self._running
                if (running is not None and msg["header"]["msg_type"] == "status"
                        and msg["content"].get("execution_state") == "idle"
                        and msg["parent_header"].get("msg_id") != running.get("msg_id")):
                    self._send(stream, "status", {"execution_state": "busy"},
                               {"header": running},
                               ident=args[0] if args else kwargs.get("ident"))
            return msg

    def _keep(self, msg: dict) -> None:
        kind = msg["header"]["msg_type"]
        parent = msg.get("parent_header") or {}
        if kind not in OUTPUT_TYPES or parent.get("msg_type") != "execute_request":
            return
        msg_id = parent.get("msg_id")
        if not msg_id:
            return
        cell = self._cells.get(msg_id)
        if cell is None:
            if kind == "status":
                return
            cell = self._cells[msg_id] = KeptCell(msg_id, session=parent.get("session", ""))
            while len(self._cells) > KEPT_CELLS:
                self._cells.popitem(last=False)
        cell.apply(kind, msg["content"])
        cell.recent.append(msg["header"]["msg_id"])

    def started(self, request: dict, execution_count: int | None = None) -> None:
        """The main shell began to run ``request`` (an execute request, as a message)."""
        header = request.get("header") or {}
        if header.get("msg_type") != "execute_request" or not header.get("msg_id"):
            return
        with self._lock:
            self._running = header
            msg_id = header["msg_id"]
            cell = self._cells.get(msg_id)
            if cell is None:
                cell = self._cells[msg_id] = KeptCell(msg_id, header.get("session", ""))
            # "" where the request names no cell (a console, nbclient, a server's client)
            cell.cell_id = (request.get("metadata") or {}).get("cellId") or ""
            if execution_count is not None:
                cell.execution_count = execution_count

    def ended(self) -> None:
        with self._lock:
            self._running = None

    def has_cells(self) -> bool:
        return bool(self._cells)

    def cells(self, known: frozenset = frozenset()) -> list[dict]:
        with self._lock:
            return [cell.as_message() for msg_id, cell in self._cells.items()
                    if msg_id not in known]

    def open(self, comm, msg) -> None:
        """A page opened :data:`TARGET`: the kept cells, but those it says it has already
        (``known``), in one message (sent under the lock, so that IOPub carries it after every
        output it includes)."""
        data = (msg.get("content") or {}).get("data") or {}
        known = frozenset(data.get("known") or ()) if isinstance(data, dict) else frozenset()
        with self._lock:
            comm.send({"cells": self.cells(known)})


def install(shell) -> OutputKeeper | None:
    """Keep the kernel's cells from now on (None where the session cannot be wrapped, or
    :data:`OFF_VARIABLE` says not to)."""
    kernel = shell.kernel
    session = getattr(kernel, "session", None)
    iopub = getattr(kernel, "iopub_socket", None)
    if session is None or iopub is None or os.environ.get(OFF_VARIABLE) == "0":
        return None
    keeper = kernel._ipydist_keeper = OutputKeeper(session, iopub)
    session.send = keeper.send
    # Whoever holds the same session object sends through the keeper too (the display
    # publisher, the display hook, the streams): it is one object, its attribute replaced.

    def started(info=None, execution_count: int | None = None) -> None:
        keeper.started(display.running_request(kernel), execution_count)

    # the cell that loads ipydist (whose number IPython has counted on by one already)
    started(execution_count=shell.execution_count - 1)
    shell.events.register("pre_run_cell", started)
    shell.events.register("post_run_cell", lambda result: keeper.ended())
    manager = getattr(kernel, "comm_manager", None)
    if manager is not None:
        manager.register_target(TARGET, keeper.open)
    return keeper
