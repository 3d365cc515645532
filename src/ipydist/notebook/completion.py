"""Tab completion and help (Shift-Tab, the contextual help panel) for code that runs on the
ranks: answered by rank 0, where its names live, not by the notebook's kernel, where they do
not.

Jupyter asks the kernel with ``complete_request`` and ``inspect_request``; ipykernel answers
through its ``do_complete`` and ``do_inspect``, looked up on the kernel at every request. So
:func:`install` wraps those two: for the body of an ``%%everyrank`` cell (and any cell under
``%dist_mode everyrank``) the question goes to rank 0 with the offset of the cell's first line
taken off, and its answer comes back with it put on; for everything else, and for the
``%%everyrank`` line itself (its options, which the notebook's completer knows), ipykernel
answers as before. Rank 0's own kernel computes the answer with the same code (jedi through
IPython's completer, IPython's inspector), so what a person gets is what they would get in a
one-process notebook. Nothing of the ranks' objects is copied into the notebook.

A request waits at most :data:`ANSWER_SECONDS` for rank 0; a rank busy with a cell answers
after it (Jupyter sends these requests to the kernel's main shell, which is itself busy
running the cell then), and the notebook's own completion answers when rank 0 cannot.
"""

from __future__ import annotations

#: How long a completion or help request waits for rank 0's answer.
ANSWER_SECONDS = 2.0
#: Cells under ``%dist_mode everyrank`` that begin with these run in the notebook (the
#: mode's input transformer leaves them alone, and completion answers them here).
RUN_HERE = ("%dist_", "%everyrank", "%%everyrank")


def rank_code(code: str, cursor_pos: int, everyrank_mode: bool) -> tuple[str, int] | None:
    """(the code rank 0 sees, the offset of its start in ``code``), when the cursor is in
    code that runs on the ranks; None otherwise (the notebook answers)."""
    stripped = code.lstrip()
    if stripped.startswith("%%everyrank"):
        newline = code.find("\n", len(code) - len(stripped))
        if newline < 0 or cursor_pos <= newline:
            return None  # on the magic's own line: its options
        return code[newline + 1:], newline + 1
    if everyrank_mode and not stripped.startswith(RUN_HERE):
        return code, 0
    return None


def shifted(reply: dict, offset: int) -> dict:
    """A rank's completion reply, its positions moved by ``offset`` (into the whole cell)."""
    reply = dict(reply)
    reply["cursor_start"] = reply.get("cursor_start", 0) + offset
    reply["cursor_end"] = reply.get("cursor_end", 0) + offset
    metadata = dict(reply.get("metadata") or {})
    key = "_jupyter_types_experimental"
    if key in metadata:
        metadata[key] = [{**m, "start": m["start"] + offset, "end": m["end"] + offset}
                         for m in metadata[key]]
    reply["metadata"] = metadata
    return reply


def headed(reply: dict, rank: int) -> dict:
    """A rank's help reply, naming the rank it came from at the top of each text."""
    if not reply.get("found"):
        return reply
    data = dict(reply.get("data") or {})
    if "text/plain" in data:
        data["text/plain"] = f"[rank {rank}]\n{data['text/plain']}"
    if "text/html" in data:
        data["text/html"] = f"<p><b>rank {rank}</b></p>{data['text/html']}"
    return {**reply, "data": data}


def install(shell, magics) -> None:
    """Answer completion and help requests of ``shell``'s kernel from rank 0 for code that
    runs on the ranks (see the module docstring). Nothing where there is no kernel (a
    terminal IPython asks its own completer, which this leaves alone)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "_ipydist_completion", False):
        return
    local_complete, local_inspect = kernel.do_complete, kernel.do_inspect

    def ask(name: str, code: str, cursor_pos: int, *args):
        """Rank 0's answer for ``code``, or None where the notebook should answer."""
        session = magics.session  # never start a cluster for a completion
        routed = rank_code(code, cursor_pos, magics.mode == "everyrank")
        if routed is None or session is None or not session.running:
            return None, 0
        body, offset = routed
        try:
            reply = session.cluster.call(name, body, cursor_pos - offset, *args,
                                         timeout=ANSWER_SECONDS, ranks=[0])[0]
        except Exception:  # busy past the limit, or gone: the notebook answers
            return None, 0
        return reply, offset

    def do_complete(code, cursor_pos):
        reply, offset = ask("complete", code, cursor_pos)
        return local_complete(code, cursor_pos) if reply is None else shifted(reply, offset)

    def do_inspect(code, cursor_pos, detail_level=0, omit_sections=()):
        reply, _ = ask("inspect_name", code, cursor_pos, detail_level, list(omit_sections))
        if reply is None:
            return local_inspect(code, cursor_pos, detail_level, omit_sections)
        return headed(reply, 0)

    kernel.do_complete, kernel.do_inspect = do_complete, do_inspect
    kernel._ipydist_completion = True
