"""The notebook's questions that a rank answers while its cell runs: where it is (its stack),
the command typed at its pdb prompt, and completion and help on its names.

An engine's cells run on its shell channel, one request at a time, so a busy rank takes no
other request there. Its control channel has a thread of its own (ipykernel's, through which
ipyparallel sends aborts and signals): a handler for ``protocol.CONTROL_REQUEST`` registered on
it answers at once, whatever the cell is doing, without interrupting it. ipyparallel's nanny
relays request types it does not know to the engine, and the client matches the reply to its
request by the request's id.
"""

from __future__ import annotations

from ipydist import protocol
from ipydist.rank.introspection import completion, debugger, stacks


def install(kernel) -> None:
    """Answer ``protocol.CONTROL_REQUEST`` on ``kernel``'s control channel (the engine's
    kernel; once, after it registered)."""
    kernel.control_handlers[protocol.CONTROL_REQUEST] = lambda stream, idents, msg: _answer(
        kernel, stream, idents, msg)


def _answer(kernel, stream, idents, msg) -> None:
    request = msg["content"]
    try:
        content = {"status": "ok", **answer(request)}
    except Exception as e:  # a reply always goes back: the notebook waits for it
        content = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    kernel.session.send(stream, protocol.CONTROL_REPLY, content, parent=msg, ident=idents)


def answer(request: dict) -> dict:
    """The answer to one request: ``{"what": "stack"}``, ``{"what": "debug", "command"}``,
    ``{"what": "complete" | "inspect", "code", "cursor_pos", ...}``, or ``{"what": "warm"}``
    (load the completer now)."""
    what = request.get("what")
    if what == "stack":
        return stacks.main_stack(at_prompt=debugger.stopped())
    if what == "debug":
        return {"delivered": debugger.deliver(str(request.get("command", "")))}
    if what in ("complete", "inspect"):
        return completion.answer(request)
    if what == "warm":
        return completion.warm()
    raise ValueError(f"unknown request {what!r}")
