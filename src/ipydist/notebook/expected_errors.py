"""A cell tagged ``raises-exception`` that fails lets Run All go on, in JupyterLab and
Notebook 7 as in a headless run.

The tag is Jupyter's mark of a cell whose error is expected: nbclient (``ipydist run``) and
nbval go on past it, and JupyterLab sends such a cell with ``stop_on_error: false``, so the
kernel runs the cells queued after it. But JupyterLab's Run All (Notebook 7's is the same
code) stops at any error reply: it sets the cells below back to ``[ ]``, and their output
never shows while the kernel runs them unseen. So an ipydist magic in a tagged cell shows its
error as IPython would (the same error output: name, message, traceback) and then returns:
the reply is ``ok`` and the run goes on. Untagged cells, and cells that are not ipydist's
magics, keep Jupyter's behaviour; an interrupt (the stop button) is never taken as expected.
"""

from __future__ import annotations

import functools

from ipydist.notebook.output import display

#: Jupyter's cell tag for "this cell is expected to raise".
TAG = "raises-exception"


def running_cell_tags() -> list[str]:
    """The tags of the notebook cell the kernel is running (a front end sends the cell's
    metadata with its request); empty outside a kernel or for a request without them."""
    tags = (display.running_request().get("metadata") or {}).get("tags")
    return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


def shown_when_expected(magic):
    """``magic``, showing the error instead of raising it where the running cell is tagged
    :data:`TAG`."""

    @functools.wraps(magic)
    def run(*args, **kwargs):
        try:
            return magic(*args, **kwargs)
        except Exception:
            if TAG not in running_cell_tags():
                raise
            from IPython import get_ipython

            get_ipython().showtraceback()
            return None

    return run
