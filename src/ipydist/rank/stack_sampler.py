"""What a rank waits in: the rank half of stall warnings and of release.

The watcher thread (:mod:`ipydist.rank.watcher`) feeds :class:`CollectiveSampler` the main
thread's stack every SAMPLE_SECONDS. When the same collective call has run for
REPORT_AFTER_SECONDS, it says so (one small data message, ``protocol.STATE_KEY``), and again
when it returns. Sampling rather than hooking sees collectives called from any code, and a
training loop pays nothing.

A collective is a public function of ``torch.distributed``, or a function of ipydist's marked
with :func:`ipydist.torch._core.marks.waits_for_peers` (the optimizer's gradient wait). When the
main thread is in none, the other threads' stacks are looked at too: a GPU parameter's gradient
hook runs on autograd's thread for that device while the main thread waits in ``backward()``,
and the optimizer's check of the step waits there. A release that finds it breaks the group,
the wait raises in that thread, and autograd raises it again in ``backward()``.
"""

from __future__ import annotations

import sys
import threading

#: Where ipydist's marked waits are (:mod:`ipydist.torch._core.marks`). Read from
#: ``sys.modules``, not imported: the watcher starts before torch is imported (and before
#: CUDA_VISIBLE_DEVICES is set), and until torch/ is loaded no function is marked anyway.
_MARKS_MODULE = "ipydist.torch._core.marks"

#: How often the watcher thread looks at the main thread's stack.
SAMPLE_SECONDS = 0.5
#: A rank reports a collective call once it has been in it this long (shorter calls are normal;
#: the notebook releases at once ranks that all wait in a collective after another failed).
REPORT_AFTER_SECONDS = 0.5


def marked_wait(code) -> str | None:
    """What an ipydist function marked with ``waits_for_peers`` waits for, else None."""
    marks = sys.modules.get(_MARKS_MODULE)
    return marks.marked_wait(code) if marks is not None else None


def collective_frame(frame) -> tuple[object, str] | None:
    """The innermost frame of a collective call on this stack (the main thread's) and the
    collective's name (e.g. ``"all_reduce"``); when it is in none, the same on another
    thread's stack, the caller's excepted (see the module docstring); else None."""
    found = _on_stack(frame)
    if found is not None or frame is None:
        return found
    me = threading.get_ident()
    for ident, other in sys._current_frames().items():
        if ident != me and other is not frame:
            found = _on_stack(other)
            if found is not None:
                return found
    return None


def _on_stack(frame) -> tuple[object, str] | None:
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        name = frame.f_code.co_name
        if "/torch/distributed/" in path and not name.startswith("_"):
            return frame, name
        marked = marked_wait(frame.f_code)
        if marked is not None:
            return frame, marked
        frame = frame.f_back
    return None


class CollectiveSampler:
    """Rank side: turns stack samples into "waiting in X" / "no longer waiting" reports.

    The same call is recognised by its frame object, which the sampler keeps referenced
    between samples so that a new call cannot reuse it.
    """

    def __init__(self, report_after: float = REPORT_AFTER_SECONDS):
        self.report_after = report_after
        self._frame: object = None
        self._name: str | None = None
        self._since = 0.0
        self._reported = False

    def sample(self, stack, now: float) -> dict | None:
        """Feed the main thread's current frame (other threads are looked at through
        :func:`collective_frame`); returns a report to send, or None."""
        found = collective_frame(stack)
        if found is not None and found[0] is self._frame:
            if not self._reported and now - self._since >= self.report_after:
                self._reported = True
                return {"collective": self._name, "waited": now - self._since}
            return None
        report = {"collective": None} if self._reported else None
        self._frame, self._name = found if found is not None else (None, None)
        self._since, self._reported = now, False
        return report

    @property
    def following(self) -> bool:
        """Whether the last sample found a collective call (whose frame it keeps, and whose
        wait it may have reported): the next sample lets it go."""
        return self._frame is not None

    def current(self, now: float) -> dict:
        """What the last sample found: ``{"collective": name, "waited": seconds}``, or
        ``{"collective": None}`` outside one (no new look at the stack)."""
        if self._name is None:
            return {"collective": None}
        return {"collective": self._name, "waited": round(now - self._since, 1)}


