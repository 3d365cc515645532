"""Where this rank's cell is right now: its main thread's stack, trimmed to the cell's code and
what it calls, for ``%dist_stack`` and the stall warning.

Read from another thread (the engine's control thread, free while a cell runs) with
``sys._current_frames()``: nothing is interrupted and the cell pays nothing. Frames of the
machinery around a cell (IPython, ipykernel, ipyparallel, asyncio) are left out; frames of the
cell are named as the notebook numbers cells (``cell 5, line 14``), others by file and line.
"""

from __future__ import annotations

import os

from ipydist.rank import stack_sampler, watcher

#: Innermost frames kept per stack (the cell's outermost frame is always kept).
KEEP_FRAMES = 6

#: Packages whose frames are the machinery around a cell, not what it runs.
_MACHINERY = ("/IPython/", "/ipykernel/", "/ipyparallel/", "/asyncio/", "/tornado/",
              "/zmq/", "/traitlets/", "/runpy.py", "/threading.py", "/selectors.py",
              "/bdb.py", "/pdb.py", "/cmd.py", "/queue.py")


def is_machinery(filename: str) -> bool:
    """Whether a frame of ``filename`` belongs to the machinery around a cell."""
    path = filename.replace("\\", "/")
    return any(part in path for part in _MACHINERY)


def place(filename: str, line: int) -> str:
    """``cell N, line L`` for the code of a cell, else ``file.py:L``."""
    return _place(filename, line, _cell_number(filename))


def _place(filename: str, line: int, number: int | None) -> str:
    if number is not None:
        return f"cell {number}, line {line}"
    return f"{os.path.basename(filename)}:{line}"


def in_cell_code(frame, depth: int = 200) -> bool:
    """Whether ``frame`` is a cell's code, or code a cell called (a cell's frame is on its
    stack), as opposed to the kernel's own that runs the cell."""
    while frame is not None and depth > 0:
        if _cell_number(frame.f_code.co_filename) is not None:
            return True
        frame, depth = frame.f_back, depth - 1
    return False


def _cell_number(filename: str) -> int | None:
    try:
        from IPython import get_ipython

        shell = get_ipython()
        return shell.compile._filename_map.get(filename) if shell is not None else None
    except Exception:
        return None


def main_stack(at_prompt: bool = False) -> dict:
    """This rank's main thread: ``{"state", "frames", "collective"}``. ``state`` is
    ``"debugger"`` (``at_prompt``: stopped at a pdb prompt), ``"running"`` (in a cell) or
    ``"idle"``; ``frames``, innermost first, are ``[function, place]`` pairs; ``collective``
    is what it waits in (as the stall warning names it), or None."""
    frame = watcher.main_frame()
    found = stack_sampler.collective_frame(frame)
    state = "debugger" if at_prompt else "running" if watcher.in_cell() else "idle"
    # in a collective: from its call outward (what it does inside differs between ranks
    # from one moment to the next, and would split ranks that wait alike)
    start = found[0] if found and not at_prompt and _on(found[0], frame) else frame
    return {"state": state, "frames": _frames(start) if state != "idle" else [],
            "collective": found[1] if found else None}


def _on(wanted, frame) -> bool:
    """Whether ``wanted`` is on the stack that ``frame`` is the top of (the sampler also
    finds collectives on autograd's threads)."""
    while frame is not None:
        if frame is wanted:
            return True
        frame = frame.f_back
    return False


def _frames(frame) -> list[list[str]]:
    frames = []
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        number = _cell_number(frame.f_code.co_filename)
        in_cell = number is not None
        if in_cell or not is_machinery(path):
            if "/ipydist/rank/" not in path:  # the debugger's own frames
                frames.append([frame.f_code.co_name if not in_cell or frame.f_code.co_name
                               != "<module>" else "<cell>",
                               _place(frame.f_code.co_filename, frame.f_lineno, number)])
        frame = frame.f_back
    cells = [i for i, (_, where) in enumerate(frames) if where.startswith("cell ")]
    if cells:  # nothing outward of the cell's own code (runpy's, the engine's)
        frames = frames[:cells[-1] + 1]
    if len(frames) > KEEP_FRAMES:
        frames = frames[:KEEP_FRAMES - 1] + frames[-1:]
    return frames
