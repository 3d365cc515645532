"""While a cell runs, a page that opens the notebook is answered at once.

JupyterLab asks a kernel it connects to for its ``kernel_info`` before anything else, and
waits for the answer: until then it drops every message of the kernel's (widget state, comm
replies), sends its comms on the main shell rather than on subshells, and its status bar reads
"Unknown". ipykernel 7 hands every shell request without a subshell id to the main shell,
which is busy with the running cell; so a page reopened during an hour's training showed
"Unknown", "Loading widget…" and ipydist's panel "asking the kernel…" until the cell ended.

The two requests a page sends first need nothing of the main thread: the ``kernel_info``
reply is fixed data, and ``comm_info`` lists the comms. While the main shell is busy, the
shell channel thread (where ipykernel routes each shell message) answers them itself, as
ipykernel would (busy, reply, idle on IOPub; the keeper of
:mod:`~ipydist.notebook.reopen.kept_cells` then says "busy" again for the running cell, so
the page's status bar reads Busy). Everything else takes its usual way. With the answer, the
page's comms go to subshells (JupyterLab's default for a kernel that has them), which run
while the cell runs: widgets get their state, the panel connects, and ipydist's catch-up
(:mod:`ipydist.notebook.reopen.kept_cells`) is asked.

ipykernel 7.4 sends the page's messages on a comm to where the kernel last sent on it from,
not to the subshell the page chose (so that an async cell awaiting a widget's reply gets it):
for a widget made in a cell, that is the busy main shell. While it is busy, two kinds go to the
page's subshell after all (or, where it named none, as JupyterLab does with a comm's first
messages, to a subshell of ipydist's own): ``request_state`` (a page that opened asks every
widget for its state; answering reads the traits, nothing more), and every message on a comm
that ipydist marks (:func:`any_thread`: its live chart's requests for points and CSV,
answered from data that only grows).

The reply to ``kernel_info`` says ``ipydist_kept_cells`` wherever cells are kept (at any
time, busy or not), which is how the page's ipydist extension knows to ask for them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipydist.notebook.reopen.kept_cells import OutputKeeper

log = logging.getLogger(__name__)

#: The requests answered by the shell channel thread (where no subshell was named).
ANSWERED = frozenset({"kernel_info_request", "comm_info_request"})
#: The mark of a comm whose messages may be handled in any thread (:func:`any_thread`).
ANY_THREAD = "_ipydist_any_thread"
#: The key the kernel_info reply carries for ipydist's catch-up (see the module docstring).
KEPT_KEY = "ipydist_kept_cells"


class BusyShell:
    """The shell channel thread's router, with the two answers in front of ipykernel's."""

    def __init__(self, kernel, keeper: OutputKeeper | None) -> None:
        self.kernel = kernel
        self.keeper = keeper
        self.route = kernel.shell_channel_thread_main  # ipykernel's own
        #: How many requests were answered or sent on here (the tests read it).
        self.answered = 0
        #: ipydist's own subshell, made for the first comm message that names none.
        self.subshell_id: str | None = None

    async def __call__(self, msg) -> None:
        try:
            if self._answer(msg):
                return
        except Exception:  # never lose a request to this: ipykernel answers it then
            log.exception("ipydist could not answer a shell request early")
        await self.route(msg)

    def _busy(self) -> bool:
        lock = getattr(self.kernel, "_main_asyncio_lock", None)
        return lock is not None and lock.locked()

    def _answer(self, msg) -> bool:
        kernel, session = self.kernel, self.kernel.session
        kept = self.keeper is not None and self.keeper.has_cells()
        busy = self._busy()
        if not busy and not kept:
            return False
        idents, frames = session.feed_identities(msg, copy=False)
        if len(frames) < 5:
            return False  # ipykernel says what is wrong with it
        # the header alone, its signature unchecked: enough to choose; what is answered here
        # is deserialized (and checked) below, what is sent on is checked where it goes
        header = session.unpack(_frame_bytes(frames[1]))
        kind = header.get("msg_type")
        if kind == "comm_msg" and busy:
            return self._to_subshell(msg, frames, header.get("subshell_id"))
        if kind not in ANSWERED or header.get("subshell_id") is not None:
            return False
        if kind == "comm_info_request" and not busy:
            return False
        parent = session.deserialize(frames, content=True, copy=False)
        kernel._publish_status("busy", "shell", parent)
        if kind == "kernel_info_request":
            content = {"status": "ok", **kernel.kernel_info}
            if kept:
                content[KEPT_KEY] = True
            session.send(kernel.shell_stream, "kernel_info_reply", content, parent, idents)
        else:
            session.send(kernel.shell_stream, "comm_info_reply",
                         {"status": "ok", "comms": _comms(kernel, parent["content"])},
                         parent, idents)
        kernel._publish_status("idle", "shell", parent)  # (then "busy" again: kept_cells)
        self.answered += 1
        return True

    def _to_subshell(self, msg, frames, subshell_id: str | None) -> bool:
        """Send a comm message to the subshell the page chose (or ipydist's), where it may go
        there (see the module docstring); False to leave it to ipykernel."""
        kernel = self.kernel
        # unpacked here, not deserialized: that would note its signature as seen, and the
        # subshell, deserializing it again, would drop it as a replay
        content = kernel.session.unpack(_frame_bytes(frames[4]))
        data = content.get("data")
        comm = getattr(kernel, "comm_manager", None)
        comm = comm.get_comm(content.get("comm_id")) if comm is not None else None
        if comm is None or not (getattr(comm, ANY_THREAD, False) or (
                isinstance(data, dict) and data.get("method") == "request_state")):
            return False
        manager = kernel.shell_channel_thread.manager
        try:
            if subshell_id is None:
                if self.subshell_id is None:
                    self.subshell_id = manager._create_subshell()
                subshell_id = self.subshell_id
            socket = manager.get_shell_channel_to_subshell_socket(subshell_id)
        except Exception:  # no such subshell (any more): ipykernel says so
            return False
        socket.send_multipart(msg, copy=False)
        self.answered += 1
        return True


def _frame_bytes(frame) -> bytes:
    return bytes(getattr(frame, "bytes", frame))


def any_thread(widget) -> None:
    """Let the page's messages to ``widget`` be handled in the page's subshell while a cell
    runs (its handlers must then be safe in any thread)."""
    comm = getattr(widget, "comm", None)
    if comm is not None:
        setattr(comm, ANY_THREAD, True)


def _comms(kernel, content: dict) -> dict:
    target = content.get("target_name")
    manager = getattr(kernel, "comm_manager", None)
    comms = dict(getattr(manager, "comms", {}))  # a copy: the main thread may add one
    return {comm_id: {"target_name": comm.target_name} for comm_id, comm in comms.items()
            if target is None or comm.target_name == target}


def install(kernel, keeper: OutputKeeper | None) -> BusyShell | None:
    """Put the router in front of ipykernel's, in the shell channel thread (None where this
    ipykernel has no such thread)."""
    thread = getattr(kernel, "shell_channel_thread", None)
    stream = getattr(kernel, "shell_stream", None)
    if thread is None or stream is None or not hasattr(kernel, "shell_channel_thread_main"):
        return None
    router = BusyShell(kernel, keeper)
    # on_recv changes the stream's handlers, so it is called in the stream's own thread
    stream.io_loop.add_callback(stream.on_recv, router, copy=False)
    kernel._ipydist_busy_shell = router
    return router
