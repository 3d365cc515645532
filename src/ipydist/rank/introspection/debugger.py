"""pdb on a rank, driven from the notebook: ``breakpoint()`` in a cell, and post-mortem on the
traceback of the cell that failed here.

A rank has no terminal: mpiexec started it, and ipyparallel gives its cells no stdin. So the
debugger's input and output travel to the notebook, where a person types at an ``input()``
prompt (Jupyter's stdin channel) as at any pdb prompt.

- ``breakpoint()`` (Python's hook, set here on every rank) stops the cell's main thread in a
  :class:`RankPdb`. Each time pdb wants a command, the rank sends what pdb printed and its
  prompt, ``(Pdb rank N)``, as a data message (``protocol.DEBUG_KEY``), then waits for the
  notebook's command, which arrives on the engine's control channel (its own thread, free while
  the cell runs: :mod:`ipydist.rank.control` calls :func:`deliver`). When pdb lets the cell go on
  (``c``, or ``q``, which stops the cell with ``BdbQuit`` as in any notebook), the rank says
  so. An interrupt (the notebook's stop button, a release) raises KeyboardInterrupt in the
  cell, as it would without the debugger.
- Post-mortem (:func:`post_mortem`), when no cell runs: each command is one request of the
  notebook's, and pdb works on the traceback IPython kept of the rank's last error.

Which ranks stop at ``breakpoint()`` the notebook says per cell (:func:`cell_settings`); on the
others, and where nobody can type (a notebook run headless), it prints one line and goes on.
``PYTHONBREAKPOINT=0`` turns every breakpoint off, as in plain Python.
"""

from __future__ import annotations

import io
import itertools
import os
import pdb
import queue
import sys
import threading
import types

from ipydist import protocol
from ipydist.rank import channel, watcher
from ipydist.rank.introspection import stacks

#: How often a rank waiting for a command looks up (an interrupt is raised between waits).
_WAIT_SECONDS = 0.2

_commands: queue.SimpleQueue[str] = queue.SimpleQueue()
_sequence = itertools.count(1)
#: The debugger stopped in the running cell, if any (the control thread asks).
_active: RankPdb | None = None
#: The request of the cell in which a breakpoint was last ignored (one line says so).
_ignored_in: str | None = None
_post_mortem: RankPdb | None = None
#: Whether a debugger set a trace function in the running cell (see :func:`_untrace`).
_traced = False
_lock = threading.Lock()


def install(shell) -> None:
    """Make ``breakpoint()`` open :class:`RankPdb` on this rank (unless PYTHONBREAKPOINT
    says otherwise; then Python's own rule applies), and end any tracing a debugger left on
    when ``shell``'s cell ends (call once, from the main thread)."""
    if os.environ.get("PYTHONBREAKPOINT", "") in ("", "pdb.set_trace"):
        sys.breakpointhook = _breakpoint
    if _untrace not in shell.events.callbacks["post_run_cell"]:
        shell.events.register("post_run_cell", _untrace)
    watcher.breakpoints_with(stopped)


def _untrace(*_) -> None:
    """After a cell in which the debugger stopped: no trace function outlives it (stepping
    off the cell's end leaves pdb's on, and every later call would pay for it)."""
    global _traced
    if _traced:
        _traced = False
        sys.settrace(None)


def _rank() -> int:
    from ipydist.torch._core import topology

    rt = topology.get()
    return rt.rank if rt is not None else 0


def _stopping() -> list[int] | None:
    """The ranks whose ``breakpoint()`` stops in the running cell, as the notebook said in
    the cell's request (None: nobody can type at a prompt)."""
    from IPython import get_ipython

    try:
        metadata = get_ipython().kernel.get_parent("shell").get("metadata") or {}
    except Exception:
        return None
    ranks = metadata.get(protocol.DEBUG_RANKS_KEY)
    return [int(r) for r in ranks] if isinstance(ranks, list) else None


#: Modules pdb does not stop in while stepping (``n`` at a cell's last line would otherwise
#: step into the kernel that ran it).
_SKIP = ["IPython.*", "ipykernel.*", "ipyparallel.*", "asyncio.*", "tornado.*", "zmq.*",
         "traitlets.*", "ipydist.rank.*"]


class RankPdb(pdb.Pdb):
    """pdb whose prompt is in the notebook: input from the control channel, output sent in
    data messages (``interactive``), or collected for one request at a time (post-mortem)."""

    def __init__(self, interactive: bool):
        self.out = io.StringIO()
        # _Input is a file to pdb only by its readline (use_rawinput off), all pdb reads
        stdin = _Input(self) if interactive else io.StringIO()
        super().__init__(stdin=stdin, stdout=self.out,  # type: ignore[arg-type]
                         nosigint=True, readrc=False, skip=_SKIP)
        self.use_rawinput = False
        self.prompt = f"(Pdb rank {_rank()}) "
        self.interactive = interactive

    def take_output(self) -> str:
        """What pdb printed since last asked, less the prompt it writes before reading a
        command (the notebook shows the prompt with its input box)."""
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text.removesuffix(self.prompt)

    def format_stack_entry(self, frame_lineno, lprefix: str = ": ") -> str:
        """pdb's line for a frame, a cell's code named as the notebook numbers cells (``cell
        4, line 2, in <module>()``) rather than by the file IPython compiled it as."""
        text = super().format_stack_entry(frame_lineno, lprefix)
        frame, line = frame_lineno
        where = stacks.place(frame.f_code.co_filename, line)
        if where.startswith("cell "):
            text = text.replace(f"{self.canonic(frame.f_code.co_filename)}({line})",
                                f"{where}, in ", 1)
        return text

    def stop_here(self, frame) -> bool:
        # only in the cell's code and what it calls: stepping past a cell's last line goes on
        # to the end of the cell, not into the kernel that runs it
        return stacks.in_cell_code(frame) and super().stop_here(frame)

    def user_call(self, frame, argument_list) -> None:
        if frame.f_code.co_name == "<module>":  # a cell's next statement: stop at its line
            return
        super().user_call(frame, argument_list)

    def user_return(self, frame, return_value) -> None:
        try:
            super().user_return(frame, return_value)
        finally:  # (an interrupt at the prompt too)
            if frame.f_code.co_name == "<module>":  # a cell's locals are the user's names:
                frame.f_locals.pop("__return__", None)  # pdb's note of the value stays out

    def _cmdloop(self) -> None:
        # pdb's own loop catches KeyboardInterrupt and prompts again: here an interrupt is
        # the notebook's stop button (or a release), and must end the cell as it would
        self.allow_kbdint = True
        try:
            self.cmdloop()
        finally:
            self.allow_kbdint = False

    def interaction(self, frame, traceback) -> None:
        global _active
        _active = self
        try:
            super().interaction(frame, traceback)
        finally:
            _active = None
            if self.interactive:
                _send(output=self.take_output(), ended=True)


class _Input:
    """pdb's stdin on a rank: sends what pdb printed and its prompt, then waits for a command
    from the notebook."""

    def __init__(self, debugger: RankPdb):
        self.debugger = debugger

    def readline(self) -> str:
        _send(output=self.debugger.take_output(), prompt=self.debugger.prompt)
        while True:
            try:
                return _commands.get(timeout=_WAIT_SECONDS) + "\n"
            except queue.Empty:
                continue


def _send(**state) -> None:
    channel.publish(protocol.DEBUG_KEY, {"seq": next(_sequence), "rank": _rank(), **state})


def deliver(command: str) -> bool:
    """A command typed in the notebook, for the debugger stopped in the running cell (called
    from the control thread); False if none is stopped here."""
    if _active is None:
        return False
    _commands.put(command)
    return True


def stopped() -> bool:
    """Whether this rank's cell is stopped in the debugger, at a prompt."""
    return _active is not None


def _breakpoint(*args, **kwargs) -> None:
    """``sys.breakpointhook`` on a rank."""
    global _ignored_in
    frame = sys._getframe(1)
    stopping, rank = _stopping(), _rank()
    if stopping is None or rank not in stopping:
        cell = _cell_request()
        if _ignored_in != cell:  # one line per cell
            _ignored_in = cell
            why = ("nobody can type at a prompt here (no stdin)" if stopping is None
                   else "breakpoints stop on " + _ranks_text(stopping))
            print(f"ipydist: breakpoint() ignored on rank {rank}: {why}", flush=True)
        return
    while not _commands.empty():  # a command left over from an earlier stop
        _commands.get_nowait()
    global _traced
    _traced = True
    RankPdb(interactive=True).set_trace(frame)


def _cell_request() -> str | None:
    from IPython import get_ipython

    try:
        return get_ipython().kernel.get_parent("shell")["header"]["msg_id"]
    except Exception:
        return None


def _ranks_text(ranks: list[int]) -> str:
    from ipydist.specs import describe_ranks

    return describe_ranks(ranks) if ranks else "no rank"


def post_mortem(command: str | None) -> dict:
    """One step of post-mortem debugging of this rank's last error: None starts it (pdb
    shows where the error was), a command runs in it. Returns ``{"output", "prompt",
    "ended"}``; ``q``, ``c`` and the like end it, leaving the rank as it was."""
    global _post_mortem
    debugger: RankPdb | None
    with _lock:
        if command is None:
            tb = getattr(sys, "last_traceback", None)
            if tb is None:
                return {"output": "no error on this rank to debug\n", "prompt": "",
                        "ended": True}
            debugger = _post_mortem = RankPdb(interactive=False)
            debugger.reset()
            debugger.setup(None, tb)
            debugger.print_stack_entry(debugger.stack[debugger.curindex])
            return {"output": debugger.take_output(), "prompt": debugger.prompt,
                    "ended": False}
        debugger = _post_mortem
        if debugger is None:
            return {"output": "no post-mortem session on this rank\n", "prompt": "",
                    "ended": True}
        ended = bool(debugger.onecmd(command))
        if ended:
            debugger.forget()
            _post_mortem = None
        return {"output": debugger.take_output(), "prompt": debugger.prompt, "ended": ended}


def frames_with_locals(limit: int = 20, width: int = 200, names: int = 40) -> str:
    """The frames of this rank's last error with their local variables, for where nobody can
    type at a prompt (a notebook run headless). The machinery around a cell (IPython's frames)
    is left out, and of a cell's own variables (its module's globals) the modules, functions
    and classes."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return "no error on this rank\n"
    lines = []
    frames = [(f, n) for f, n in _walk(tb) if not stacks.is_machinery(f.f_code.co_filename)]
    for frame, line in frames[-limit:]:
        code = frame.f_code
        lines.append(f"{stacks.place(code.co_filename, line)}, in {code.co_name}")
        shown = [(name, value) for name, value in frame.f_locals.items()
                 if not name.startswith("_") and not isinstance(
                     value, (types.ModuleType, types.FunctionType, type))]
        for name, value in shown[:names]:
            lines.append(f"    {name} = {_short_repr(value, width)}")
        if len(shown) > names:
            lines.append(f"    ... and {len(shown) - names} more")
    value = getattr(sys, "last_value", None)
    lines.append(f"{type(value).__name__}: {value}")
    return "\n".join(lines) + "\n"


def _short_repr(value, width: int) -> str:
    try:
        text = repr(value)
    except Exception as e:
        return f"<repr failed: {e}>"
    return text if len(text) <= width else text[:width - 3] + "..."


def _walk(tb):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
