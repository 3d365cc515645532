"""Tab completion and help (Shift-Tab, ``obj?``, the contextual help panel) for code that runs
on the ranks: answered by a rank, where its names live, not by the notebook's kernel, where
they do not.

Jupyter asks the kernel with ``complete_request`` and ``inspect_request``; ipykernel answers
through its ``do_complete`` and ``do_inspect``, looked up on the kernel at every request. So
:func:`install` wraps those two: for the body of an ``%%everyrank`` cell (and any cell under
``%dist_mode everyrank``) the question goes to a rank -- the first of the cell's ``--ranks``,
else rank 0 -- with the offset of the cell's first line taken off, and its answer comes back
with it put on; for everything else, and for the ``%%everyrank`` line itself (its options,
which the notebook's completer knows), ipykernel answers as before. The rank's own kernel
computes the answer with the same code (jedi through IPython's completer, IPython's
inspector), so what a person gets is what they would get in a one-process notebook. Nothing
of the ranks' objects is copied into the notebook.

The question travels on the engine's control channel (:mod:`ipydist.rank.completion`), which
a rank serves while its cell runs: a rank busy training still completes, from its namespace
as it is at that moment. The notebook's kernel is another matter: Jupyter sends these
requests to the kernel's main shell, busy with the running cell, unless the front end sends
them to a subshell (ipykernel 7), as a subshell console does; JupyterLab sends a notebook's
completions to the main shell. A request waits at most :data:`ANSWER_SECONDS` (a rank's first,
while its jedi loads, :data:`FIRST_ANSWER_SECONDS`). When the rank cannot answer in time, the
reply is empty (no matches, no help): the notebook's own names are not the ranks', and a wrong
name offered is worse than none (CI got the notebook's ``notebook_only_name`` for an
``%%everyrank`` cell when rank 0 was slow once: issue 46).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ipydist.notebook.introspection import control
from ipydist.specs import SpecError, parse_ranks

if TYPE_CHECKING:
    from ipydist.session_face import MagicsFace

#: How long a completion or help request waits for the rank's answer.
ANSWER_SECONDS = 2.0
#: The same for a rank that has not answered yet (the rank's own limit then is longer: see
#: :mod:`ipydist.rank.introspection.completion`).
FIRST_ANSWER_SECONDS = 6.5
#: Cells under ``%dist_mode everyrank`` that begin with these run in the notebook (the
#: mode's input transformer leaves them alone, and completion answers them here).
RUN_HERE = ("%dist_", "%everyrank", "%%everyrank")
_RANKS_OPTION = re.compile(r"--ranks(?:=|\s+)(\S+)")


def rank_code(code: str, cursor_pos: int, everyrank_mode: bool) -> tuple[str, int] | None:
    """(the code the rank sees, the offset of its start in ``code``), when the cursor is in
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


def answering_rank(code: str, size: int) -> int:
    """The rank that answers for ``code``: the first of its ``%%everyrank --ranks``, else 0
    (the rank whose namespace the cell's own code sees first)."""
    stripped = code.lstrip()
    if stripped.startswith("%%everyrank"):
        found = _RANKS_OPTION.search(stripped.split("\n", 1)[0])
        if found:
            try:
                return parse_ranks(found.group(1), size)[0]
            except (SpecError, IndexError):
                pass
    return 0


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


def headed(data: dict, rank: int) -> dict:
    """A mime bundle of help, naming the rank it came from at the top of each text."""
    data = dict(data)
    if "text/plain" in data:
        data["text/plain"] = f"[rank {rank}]\n{data['text/plain']}"
    if "text/html" in data:
        data["text/html"] = f"<p><b>rank {rank}</b></p>{data['text/html']}"
    return data


def ask_rank(cluster, rank: int, request: dict, timeout: float = ANSWER_SECONDS) -> dict | None:
    """``rank``'s kernel's reply to a completion or help ``request``; None when it could not
    answer in time."""
    answer = control.ask_ranks(cluster, [rank], request, timeout)[rank]
    if not answer or answer.get("status") != "ok" or "reply" not in answer:
        return None
    return answer["reply"]


def unanswered(what: str, cursor_pos: int) -> dict:
    """The reply for code on the ranks when no rank answered: nothing, rather than the
    notebook's names."""
    if what == "complete":
        return {"status": "ok", "matches": [], "cursor_start": cursor_pos,
                "cursor_end": cursor_pos, "metadata": {}}
    return {"status": "ok", "found": False, "data": {}, "metadata": {}}


def install(shell, magics: MagicsFace) -> None:
    """Answer completion and help requests of ``shell``'s kernel from a rank for code that
    runs on the ranks (see the module docstring). Nothing where there is no kernel (a
    terminal IPython asks its own completer, which this leaves alone)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "_ipydist_completion", False):
        return
    local_complete, local_inspect = kernel.do_complete, kernel.do_inspect
    answered: set[tuple[int, int]] = set()  # (the cluster's id, an engine that answered)

    def ask(what: str, code: str, cursor_pos: int, **more):
        """(the rank's reply, the offset of its code in the cell, the rank): None where the
        notebook answers (its own code, or no cluster), :func:`unanswered` where the rank
        did not."""
        session = magics.session  # never start a cluster for a completion
        routed = rank_code(code, cursor_pos, magics.mode == "everyrank")
        cluster = session.cluster if session is not None and session.running else None
        if routed is None or session is None or cluster is None:
            return None, 0, 0
        body, offset = routed
        rank = answering_rank(code, session.size)
        try:
            engine = (id(cluster), cluster.engine_ids[rank])
            limit = ANSWER_SECONDS if engine in answered else FIRST_ANSWER_SECONDS
            reply = ask_rank(cluster, rank, {"what": what, "code": body,
                                             "cursor_pos": cursor_pos - offset, **more}, limit)
        except Exception:  # the cluster is going away
            reply = None
        if reply is None:
            return unanswered(what, cursor_pos), 0, rank
        answered.add(engine)
        return reply, offset, rank

    def do_complete(code, cursor_pos):
        reply, offset, _ = ask("complete", code, cursor_pos)
        return local_complete(code, cursor_pos) if reply is None else shifted(reply, offset)

    def do_inspect(code, cursor_pos, detail_level=0, omit_sections=()):
        reply, _, rank = ask("inspect", code, cursor_pos, detail_level=detail_level,
                             omit_sections=list(omit_sections))
        if reply is None:
            return local_inspect(code, cursor_pos, detail_level, omit_sections)
        if reply.get("found"):
            reply = {**reply, "data": headed(reply.get("data") or {}, rank)}
        return reply

    warmed: set[tuple[int, int]] = set()  # (the cluster's id, rank 0's engine) asked to warm

    def warm_rank_0(*_) -> None:
        """After each cell: a rank 0 not yet asked (a new cluster, or a new rank 0 after a
        heal) loads its completer now, in the background, so that the first Tab answers
        within JupyterLab's 1 s (see :mod:`ipydist.rank.introspection.completion`)."""
        session = magics.session
        cluster = session.cluster if session is not None and session.running else None
        if cluster is None:
            return
        try:
            engine = (id(cluster), cluster.engine_ids[0])
            if engine not in warmed:
                warmed.add(engine)
                control.tell_rank(cluster, 0, {"what": "warm"})
        except Exception:  # the cluster is going away: the first Tab loads it then
            pass

    kernel.do_complete, kernel.do_inspect = do_complete, do_inspect
    shell.events.register("post_run_cell", warm_rank_0)
    kernel._ipydist_completion = True
