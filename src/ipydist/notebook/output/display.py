"""Showing things in the notebook: tables, progress lines, rank output, and whether there is
a front end that shows rich output at all.

Everything degrades to plain text, so the same calls read well in a terminal IPython, in a
notebook, and in a notebook saved and opened without a kernel.
"""

from __future__ import annotations

import html
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ipydist.notebook.output.lines import Redraw

if TYPE_CHECKING:
    from IPython.display import DisplayHandle


class Table:
    """A small table with a plain-text and an HTML rendering."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[object]], caption=""):
        self.columns = list(columns)
        self.rows = [["" if v is None else str(v) for v in row] for row in rows]
        self.caption = caption

    def __str__(self) -> str:
        widths = [
            max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
            for i, c in enumerate(self.columns)
        ]
        line = "  ".join(c.ljust(w) for c, w in zip(self.columns, widths))
        body = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in self.rows]
        text = "\n".join([line.rstrip(), *body])
        return f"{text}\n{self.caption}" if self.caption else text

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r) + "</tr>"
            for r in self.rows
        )
        cap = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def in_kernel() -> bool:
    """Whether a Jupyter kernel (and so a front end that shows rich output and widgets) runs
    this code, rather than a terminal IPython or a script."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return getattr(get_ipython(), "kernel", None) is not None


def running_request(kernel=None) -> dict:
    """The request of the cell ``kernel`` (by default this IPython's) runs: its header,
    content and metadata, as the front end sent it; empty outside a kernel or between
    requests."""
    if kernel is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return {}
        kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return {}
    try:
        return kernel.get_parent("shell") or {}
    except TypeError:  # an older ipykernel, without channels
        return kernel.get_parent() or {}


def updates_shown() -> bool:
    """Whether the front end that runs the cell applies a display's updates
    (``update_display_data``), so that a line can change in place and a placeholder be
    filled at the end.

    JupyterLab, Notebook 7 and VS Code name the cell in their request (``cellId``) and apply
    them; nbclient (nbconvert, papermill) allows no stdin and applies them. A request with
    neither comes from jupyter-server-nbmodel's server-side execution, which writes only new
    outputs into the document (it drops updates), or from a console, which prints each output
    once: there the final state is shown as a new output instead.
    """
    return applies_updates(running_request())


def applies_updates(request: dict) -> bool:
    """:func:`updates_shown` for this execute request (True for none: no front end to ask)."""
    if not request:
        return True
    named = "cellId" in (request.get("metadata") or {})
    return named or not (request.get("content") or {}).get("allow_stdin", True)


def show(obj) -> None:
    """Display ``obj`` richly in IPython, or print it elsewhere."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(obj)
        return
    if get_ipython() is None:
        print(obj)
    else:
        display(obj)


def publish(bundle: dict, metadata: dict | None = None) -> None:
    """Show a rank's display_data bundle in the notebook (text/plain outside IPython)."""
    try:
        from IPython import get_ipython
        from IPython.display import publish_display_data
    except ImportError:
        get_ipython = None  # noqa: N806
    if get_ipython is not None and get_ipython() is not None:
        publish_display_data(bundle, metadata or {})
    else:
        print(bundle.get("text/plain", ""))


def tag_line(text: str):
    """Show ``text`` (a rank's ``[rank N]`` above its display) as one plain-text output, as
    ipyparallel labels an engine's display; in a notebook it can be changed later (the same
    bundle came from more ranks), so it is a display with an id, and its handle is returned.
    Elsewhere it is printed, and None is returned."""
    if not in_kernel():
        print(text)
        return None
    from IPython.display import display

    return display({"text/plain": text}, raw=True, display_id=True)


def retag(handle, text: str | None) -> None:
    """Change a line shown by :func:`tag_line` (None: empty it)."""
    if handle is not None:
        handle.update({"text/plain": text or ""}, raw=True)


class Progress:
    """One status line that updates in place in a notebook and prints once per change elsewhere.

    Where the front end does not apply a display's updates (:func:`updates_shown`), each
    change is printed as a line, as in a terminal (``in_place`` is False: the caller then
    prints only when a step begins or ends), and :meth:`close` ends them with its ``final``
    line. (A line rewritten after ``\\r`` would read better, but jupyter-server-nbmodel 0.2.9
    fails the cell when it rewrites a stream that holds a non-ASCII character.)
    """

    def __init__(self):
        self._handle = None
        self._last = None
        self._kernel = in_kernel()
        #: The line changes in place (a notebook that applies a display's updates).
        self.in_place = self._kernel and updates_shown()

    def update(self, text: str) -> None:
        if text == self._last:
            return
        self._last = text
        if self.in_place:
            from IPython.display import display

            bundle = {"text/plain": text}
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
        else:
            print(text, file=sys.stdout if self._kernel else sys.stderr, flush=True)

    def close(self, final: str = "") -> bool:
        """Remove the line in a notebook (the final table replaces it); where the lines were
        printed, end them with ``final``. Whether ``final`` was shown."""
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
            self._handle = None
        elif self._kernel and not self.in_place and final and self._last is not None:
            print(final, flush=True)
            self._last = None
            return True
        return False


class Bars:
    """Each rank's text progress bar (tqdm and the like) as one line that updates in place.

    A notebook shows a stream's ``\\r`` only within one output, so the ranks' bars, written
    to one stream in turn, would overwrite one another, and a state shown before another
    rank's line would stay behind as a stale copy. Instead each bar is a display of its own,
    made where the bar's first state comes in the rank's output and updated with each later
    state (only the newest of those that arrived together); its last state ends it, and the
    next bar of the rank is a new line. Outside a notebook :meth:`show` returns False and the
    caller prints the state as it is. Where the front end does not apply a display's updates
    (:func:`updates_shown`), only a bar's last state is shown: a first state would stay.
    """

    def __init__(self):
        self._kernel = in_kernel()
        self._last_only = self._kernel and not updates_shown()
        self._handles: dict[tuple[str, str], DisplayHandle] = {}  # (tag, stream) -> its display
        self._pending: dict[tuple[str, str], str] = {}

    def show(self, tag: str, stream: str, state: Redraw) -> bool:
        """Show one state of the bar of ``tag`` on ``stream`` (its last, when ``state.last``);
        False where there is no notebook."""
        if not self._kernel:
            return False
        last = state.last
        key, text = (tag, stream), f"[{tag}] {state.rstrip()}"
        if self._last_only:
            if last:
                from IPython.display import display

                display({"text/plain": text}, raw=True)
            return True
        handle = self._handles.pop(key, None)
        if handle is None:  # a new bar: here, in order with the rank's other output
            from IPython.display import display

            handle = display({"text/plain": text}, raw=True, display_id=True)
        elif last:
            handle.update({"text/plain": text}, raw=True)
        else:
            self._pending[key] = text
        if last:
            self._pending.pop(key, None)
        else:
            self._handles[key] = handle
        return True

    def flush(self) -> None:
        """Draw the newest state of every bar that changed since the last flush."""
        for key, text in self._pending.items():
            if key in self._handles:
                self._handles[key].update({"text/plain": text}, raw=True)
        self._pending.clear()
