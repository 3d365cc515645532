"""How a rank shows an error: in full when it may be the cause, briefly when it was released.

When one rank fails, the notebook releases its peers (``ipydist.rank.watcher``) and shows the
failing rank's traceback; the peers' errors are consequences it only counts ("ranks 0-2 were
waiting in allreduce, and were released"). Yet each peer formats its own traceback before it
replies, and the cell ends only when every rank has replied. IPython's formatter parses the
source of every file in the traceback (``stack_data``), and a released collective's traceback
runs through torch's largest modules: the first such traceback took 0.3 s per rank on an idle
core, over a second with four ranks sharing two busy cores, and that is time the user waits.

So on a rank released in this cell the error is formatted by the standard library's
:mod:`traceback` (milliseconds; the same frames and source lines, without colours or context),
through IPython's own hook for exceptions that render themselves (``_render_traceback_``), which
the kernel's reply and IPython's history both use. Every other error keeps IPython's full
display. :func:`warm_up` loads IPython's formatter in the background once the rank is idle, so
the first error a failing rank shows does not pay for its imports either.
"""

from __future__ import annotations

import sys
import threading
import traceback

from ipydist.rank import watcher

#: The first line of a released rank's brief traceback, saying why it is brief.
BRIEF_HEADER = "(this rank was released after the cell failed elsewhere: its traceback in brief)"


def attach(shell) -> None:
    """Show errors of ``shell``'s cells as described above (from the main thread, once)."""
    shell.set_custom_exc((BaseException,), _show)


def _show(shell, etype, value, tb, tb_offset=None):
    """IPython's handler for an exception in a cell (``set_custom_exc``): called within the
    ``except`` that caught it, so :meth:`showtraceback` sees it as IPython itself would."""
    if watcher.released_in_this_cell():
        cell_frames = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        lines = [BRIEF_HEADER, *traceback.format_exception(etype, value, cell_frames)]
        try:
            value._render_traceback_ = lambda: [line.rstrip("\n") for line in lines]
        except Exception:  # an exception that takes no attributes: shown in full
            pass
    shell.showtraceback(tb_offset=tb_offset, running_compiled_code=True)
    return None


#: Modules that formatting an exception as IPython does imports: loaded, they say that the
#: formatter was warmed up already (by the fork server this rank was forked from).
FORMATTER_MODULES = ("pygments.lexers.python", "pygments.formatters.terminal256")
#: Whether this rank warmed the formatter up itself (False where its fork server had).
warmed_here = False


def warm_up() -> None:
    """Format one exception in a background thread, so that IPython's formatter (pygments,
    stack_data) is loaded before the first cell fails; uses a formatter of its own, not the
    shell's, so the shell's state is not shared with the thread. Nothing to do in a rank forked
    from a server that did it (``forkserver.warm_tracebacks``)."""
    global warmed_here
    if all(name in sys.modules for name in FORMATTER_MODULES):
        return
    warmed_here = True
    threading.Thread(target=_format_one, name="ipydist-warm-tracebacks", daemon=True).start()


def _format_one() -> None:
    try:
        from IPython.core.ultratb import VerboseTB

        try:
            raise ValueError("warming up the traceback formatter")
        except ValueError:
            VerboseTB().structured_traceback(*sys.exc_info())
    except Exception:  # only a warm-up: the first real error is formatted regardless
        pass
