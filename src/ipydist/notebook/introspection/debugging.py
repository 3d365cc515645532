"""The notebook's half of debugging a rank: pdb prompts for ``breakpoint()`` in a running cell,
post-mortem on a rank's last error (``%dist_debug``), and every rank's stack (``%dist_stack``).

The person types at ``input()``, which in a Jupyter kernel is a request on the stdin channel
(JupyterLab, Notebook 7 and VS Code show a box under the cell; a terminal IPython reads its
terminal). The rank side is :mod:`ipydist.rank.debugging.debugger`; stacks and commands for a
cell that runs go on the engines' control channel (:mod:`ipydist.rank.control`),
post-mortem commands as ordinary requests, since no cell runs then.
"""

from __future__ import annotations

import shlex
import sys
import textwrap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ipydist import protocol
from ipydist.errors import MESSAGE_WIDTH
from ipydist.notebook.introspection import control
from ipydist.specs import SpecError, describe_ranks

if TYPE_CHECKING:
    from ipydist.session_face import SessionFace

#: How long ``%dist_stack`` waits for the ranks' answers (a rank that does not answer in
#: time is named as such: its control thread is stuck, or it is gone).
STACK_SECONDS = 2.0
#: How long a pdb command typed at a post-mortem prompt may run on the rank.
COMMAND_SECONDS = 120.0


def can_prompt() -> bool:
    """Whether a person can answer ``input()`` here: the Jupyter request allows stdin, or a
    terminal is attached (a notebook run headless, by nbclient or ``ipydist run``, has none)."""
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:
        kernel = None
    if kernel is not None:
        return bool(getattr(kernel, "_allow_stdin", False))
    return bool(sys.stdin is not None and sys.stdin.isatty())


def ask(prompt: str) -> str:
    """One line typed by the person; ``c`` (go on) when input has ended."""
    try:
        return input(prompt)
    except EOFError:
        return "c"


# --- breakpoint() in a running cell --------------------------------------------------------

class Breakpoints:
    """The pdb prompts of one cell, one rank at a time: :meth:`accept` takes what the ranks'
    debuggers send, :meth:`serve` asks the person and sends the command on."""

    def __init__(self, cluster, before_output: Callable[[], None],
                 ask: Callable[[str], str] = ask):
        self.cluster = cluster
        self.before_output = before_output
        self.ask = ask
        self.waiting: list[tuple[int, dict]] = []  # ranks at a prompt, in the order they came
        self._seen: dict[int, int] = {}

    def accept(self, rank: int, state: dict) -> None:
        if state.get("seq", 0) <= self._seen.get(rank, 0):
            return  # the same message, found twice (its own and the request's metadata)
        self._seen[rank] = state.get("seq", 0)
        if state.get("prompt"):
            self.waiting.append((rank, state))
        elif state.get("output"):
            self.before_output()
            print(state["output"], end="", flush=True)

    def serve(self) -> float:
        """Ask for the command of every rank at a prompt; the seconds spent asking (the cell's
        clocks stop meanwhile: no stall warning, release or timeout for a person typing)."""
        spent = 0.0
        while self.waiting:
            rank, state = self.waiting.pop(0)
            self.before_output()
            print(state.get("output", ""), end="", flush=True)
            t0 = time.monotonic()
            try:
                command = self.ask(state["prompt"])
            finally:
                spent += time.monotonic() - t0
            if not self._deliver(rank, command):
                print(f"ipydist: rank {rank} is no longer at its prompt", file=sys.stderr,
                      flush=True)
        return spent

    def _deliver(self, rank: int, command: str) -> bool:
        reply = control.ask_ranks(self.cluster, [rank], {"what": "debug", "command": command},
                                  STACK_SECONDS)[rank]
        return bool(reply and reply.get("delivered"))


# --- post-mortem ---------------------------------------------------------------------------

def post_mortem(cluster, rank: int, commands: list[str] | None = None,
                ask: Callable[[str], str] = ask, echo: bool = True) -> str:
    """pdb on ``rank``'s last error: prompts (``ask``) until ``q`` or ``c``, or runs
    ``commands`` (then ``q``). Returns what pdb printed, prompts and commands included."""
    transcript = []

    def step(command: str | None) -> dict:
        reply = cluster.call(protocol.DEBUG, command, timeout=COMMAND_SECONDS, ranks=[rank])[0]
        if echo:
            print(reply["output"], end="", flush=True)
        transcript.append(reply["output"])
        return reply

    reply = step(None)
    pending = list(commands) if commands is not None else None
    while not reply["ended"]:
        if pending is not None:
            command = pending.pop(0) if pending else "q"
            if echo:
                print(f"{reply['prompt']}{command}", flush=True)
        else:
            try:
                command = ask(reply["prompt"])
            except KeyboardInterrupt:
                command = "q"
        transcript.append(f"{reply['prompt']}{command}\n")
        reply = step(command)
    return "".join(transcript)


def unquoted(commands: list[str] | None) -> list[str] | None:
    """``%dist_debug --commands``' words as typed, without the quotes that kept one whole
    (IPython's magic arguments keep them)."""
    if commands is None:
        return None
    return [shlex.split(c)[0] if c[:1] in "'\"" and len(c) > 1 else c for c in commands]


def debug_rank(session: SessionFace, cluster, rank: int | None, commands: list[str] | None) -> str:
    """``Session.debug``: post-mortem on ``rank`` (default: the lowest that raised last)."""
    if rank is None:
        if not session.failed_ranks:
            raise SpecError("no rank raised in the last cell: name one with "
                             f"{session.words.debug}")
        rank = min(session.failed_ranks)
    if not 0 <= int(rank) < cluster.size:
        raise SpecError(f"rank {rank}: the ranks are 0..{cluster.size - 1}")
    if commands is None and not can_prompt():
        frames = cluster.call(protocol.ERROR_FRAMES, timeout=COMMAND_SECONDS, ranks=[rank])[0]
        text = (f"ipydist: nobody can type at a pdb prompt here (no stdin: a notebook run "
                f"headless); rank {rank}'s last error, its frames and their variables:\n{frames}")
        print(text, end="", flush=True)
        return text
    return post_mortem(cluster, int(rank), commands)


# --- every rank's stack --------------------------------------------------------------------

class Stacks:
    """Every rank's stack (``Session.stacks()``): ``by_rank`` as the ranks said it, shown
    collapsed where ranks agree."""

    def __init__(self, by_rank: dict[int, dict | None]):
        self.by_rank = by_rank

    def __str__(self) -> str:
        return collapse(self.by_rank)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def stacks(cluster, ranks: list[int], timeout: float = STACK_SECONDS) -> dict[int, dict | None]:
    """rank -> where its main thread is (``ipydist.rank.debugging.stacks.main_stack``), asked on the
    control channel of every rank at once; None for a rank that did not answer in time."""
    answers = control.ask_ranks(cluster, ranks, {"what": "stack"}, timeout)
    return {rank: reply if reply is not None and reply.get("status") == "ok" else None
            for rank, reply in answers.items()}


def collapse(found: dict[int, dict | None]) -> str:
    """Every rank's stack, ranks whose stacks agree together (wrapped as ipydist's messages
    are, continued lines indented):
    ``ranks 0-2: waiting in all_reduce: allreduce (collectives.py:72) ← <cell> (cell 5,
    line 14)``. Innermost frame first."""
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(found):
        groups.setdefault(_key(found[rank]), []).append(rank)
    return "\n".join(_wrapped(f"{describe_ranks(ranks)}: {_text(key)}")
                     for key, ranks in groups.items())


def _wrapped(line: str) -> str:
    """``line`` in lines of at most MESSAGE_WIDTH, broken before a caller's ``←`` where it
    can be, and at spaces where it cannot; continued lines indented."""
    first, *callers = line.split(" ← ")
    lines = [first]
    for caller in callers:
        if len(lines[-1]) + 3 + len(caller) <= MESSAGE_WIDTH:
            lines[-1] += " ← " + caller
        else:
            lines.append("    ← " + caller)
    return "\n".join(part for text in lines for part in textwrap.wrap(
        text, MESSAGE_WIDTH, subsequent_indent="    ", break_long_words=False,
        break_on_hyphens=False, drop_whitespace=False) or [text])


def _key(stack: dict | None) -> tuple:
    if stack is None:
        return ("no answer",)
    frames = tuple(tuple(f) for f in stack.get("frames", ()))
    return (stack.get("state", "running"), stack.get("collective"), frames)


def _text(key: tuple) -> str:
    if key == ("no answer",):
        return f"no answer within {STACK_SECONDS:g} s"
    state, collective, frames = key
    if state == "idle":
        return "idle (no cell running)"
    where = " ← ".join(f"{function} ({place})" for function, place in frames) or "(no frames)"
    if state == "debugger":
        return f"at a pdb prompt: {where}"
    if collective:
        return f"waiting in {collective}: {where}"
    return f"running: {where}"
