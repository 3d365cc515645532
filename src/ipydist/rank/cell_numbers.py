"""A rank numbers each cell as the notebook does, so that a traceback's ``Cell In[4]`` points
at the cell a person sees as ``[4]`` (the rank's own count runs apart: the notebook's other
cells and ipydist's own requests never reach it, or reach it unnumbered).

The notebook puts its number in the request's metadata (:data:`ipydist.protocol.CELL_NUMBER_KEY`).
IPython takes the cell's number before any of its events fire, but after transforming the
cell's text; so the number is set by an input transformer that leaves the text as it is.
The count only moves forward: the rank's input history keeps one entry per number. The
notebook gives every rank of a request the same number, and one never given before (a second
request from one notebook cell takes the next): a rank that ran fewer cells than the others
catches up, so every rank names a cell alike.
"""

from __future__ import annotations

from ipydist.protocol import CELL_NUMBER_KEY


def attach(shell) -> None:
    """Number ``shell``'s cells as the notebook's (call once, on the rank's shell)."""
    if not any(getattr(t, "__name__", "") == _take_number.__name__
               for t in shell.input_transformers_cleanup):
        shell.input_transformers_cleanup.append(_take_number)


def _take_number(lines: list[str]) -> list[str]:
    from IPython import get_ipython

    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:  # not a kernel's shell: no request either
        return lines
    try:
        metadata = kernel.get_parent("shell").get("metadata") or {}
    except Exception:  # no request (a transform asked for outside one)
        return lines
    number = metadata.get(CELL_NUMBER_KEY)
    if isinstance(number, int) and number > shell.execution_count:
        shell.execution_count = number
    return lines
