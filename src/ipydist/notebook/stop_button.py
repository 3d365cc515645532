"""The stop button (Ctrl-C: SIGINT to the kernel) while the notebook waits for a cell's ranks,
taken as a flag and raised as KeyboardInterrupt where the wait loop looks, never inside a lock.

Python raises KeyboardInterrupt in the main thread at the next point its interpreter looks,
wherever that is. Inside ``threading.Condition.__enter__``, just after the lock was taken, the
``with`` block is never entered, so never left: the lock stays held for ever. ipyparallel's
client thread then blocks in ``Future.set_result`` on that lock, no reply reaches the notebook
again, and the cell's stop waits for that thread for ever. A full run of the suite met it
(the chaos test's interrupted cell: its ranks "did not stop within 8 s", since their replies
never came; then the next stop hung until pytest's 300 s timeout).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType


class StopButton:
    """While entered (in the main thread, where Python's own handler takes SIGINT): a press
    sets :attr:`pressed`, and :meth:`check` raises it as KeyboardInterrupt. A press not yet
    checked when the wait ends is raised on leaving. Elsewhere it changes nothing: a press is
    Python's KeyboardInterrupt, as before."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Callable[[int, FrameType | None], Any] | None = None

    def __enter__(self) -> StopButton:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # not SIG_IGN or SIG_DFL: those stay as they are
                self._previous = previous
                signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, kind, error, tb) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if kind is None:
            self.check()

    def _press(self, signum, frame) -> None:
        self.pressed = True

    def check(self) -> None:
        """Raise KeyboardInterrupt here if the button was pressed since the last look."""
        if self.pressed:
            self.pressed = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def as_before(self):
        """A press is Python's KeyboardInterrupt again meanwhile (a debugger's prompt waits
        for the user, who must be able to leave it with the stop button)."""
        if self._previous is None:
            yield
            return
        signal.signal(signal.SIGINT, self._previous)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._press)
