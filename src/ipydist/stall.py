"""Stall warnings: some ranks wait in a collective that others never entered.

A collective finishes only when every rank calls it. When one rank skips it (``if rank == 0:``),
calls another one, or is still busy, the others wait without a word, and the notebook just
shows a busy cell. Horovod's coordinator notices this and writes a warning to its log; ipydist
puts the same warning under the cell.

Two halves, both pure logic so they can be tested without a cluster:

- on each rank, :class:`CollectiveSampler` is fed the main thread's stack once a second by the
  watcher thread (:mod:`ipydist.release`). When the same collective call has been running for a
  second, it says so (one small IOPub data message, ``STATE_KEY``), and again when it returns.
  The watcher samples rather than hooks, so collectives called from any code are seen, and a
  training loop pays nothing.
- in the notebook, :class:`StallWatch` collects those messages for the running cell and, once a
  rank has waited past the threshold, names the ranks that are not in that collective and
  what they are doing instead.
"""

from __future__ import annotations

from ipydist.specs import describe_ranks

#: The data-message key under which a rank reports the collective it waits in.
STATE_KEY = "ipydist.state"
#: How often the watcher thread looks at the main thread's stack.
SAMPLE_SECONDS = 1.0
#: A rank reports a collective call once it has been in it this long (shorter calls are normal).
REPORT_AFTER_SECONDS = 1.0
#: Default for ``Session(stall_warning=...)`` / ``%dist_start --stall-warning``; 0 turns it off.
STALL_WARNING_SECONDS = 30.0


def collective_frame(frame) -> tuple[object, str] | None:
    """The innermost frame of a collective call on this stack and the collective's name
    (e.g. ``"all_reduce"``), or None when the stack is not in one."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        name = frame.f_code.co_name
        if "/torch/distributed/" in path and not name.startswith("_"):
            return frame, name
        if path.endswith("ipydist/torch/optimizer.py") and name == "synchronize":
            return frame, "allreduce of gradients (DistributedOptimizer)"
        frame = frame.f_back
    return None


class CollectiveSampler:
    """Rank side: turns stack samples into "waiting in X" / "no longer waiting" reports.

    The same call is recognised by its frame object, which the sampler keeps referenced
    between samples so that a new call cannot reuse it.
    """

    def __init__(self, report_after: float = REPORT_AFTER_SECONDS):
        self.report_after = report_after
        self._frame = None
        self._name: str | None = None
        self._since = 0.0
        self._reported = False

    def sample(self, stack, now: float) -> dict | None:
        """Feed the main thread's current frame; returns a report to send, or None."""
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


class StallWatch:
    """Notebook side: what each rank of the running cell waits in, and when that is a stall."""

    def __init__(self, targets: list[int], threshold: float):
        self.targets = list(targets)
        self.threshold = threshold
        #: rank -> (collective, since), in the notebook's monotonic clock
        self.waiting: dict[int, tuple[str, float]] = {}
        self._warned: set[tuple] = set()

    def accept(self, rank: int, state: dict, now: float) -> None:
        if state.get("collective"):
            self.waiting[rank] = (state["collective"], now - float(state.get("waited", 0.0)))
        else:
            self.waiting.pop(rank, None)

    def check(self, now: float, doing: dict[int, str]) -> str | None:
        """A warning to show now, or None. ``doing`` says what each rank not waiting is doing
        instead ("running", "finished" or "failed"); each situation is reported once."""
        if not self.threshold or self.threshold <= 0 or not self.waiting:
            return None
        longest = now - min(since for _, since in self.waiting.values())
        if longest < self.threshold:
            return None
        missing = [r for r in self.targets if r not in self.waiting]
        by_name: dict[str, list[int]] = {}
        for rank in sorted(self.waiting):
            by_name.setdefault(self.waiting[rank][0], []).append(rank)
        if not missing and len(by_name) == 1:
            return None  # every rank is in the same collective: slow, not stalled
        key = (tuple(missing), tuple((n, tuple(r)) for n, r in by_name.items()))
        if key in self._warned:
            return None
        self._warned.add(key)
        return _describe(by_name, missing, doing, longest)


#: What a rank outside every collective is doing, as (one rank, several ranks).
_DOING = {
    "running": ("is still running other code", "are still running other code"),
    "finished": ("finished the cell without calling it", "finished the cell without calling it"),
    "failed": ("stopped with an error", "stopped with an error"),
}


def _describe(by_name: dict[str, list[int]], missing: list[int], doing: dict[int, str],
              longest: float) -> str:
    if len(by_name) == 1:
        [(name, ranks)] = by_name.items()
        have = "has" if len(ranks) == 1 else "have"
        waits = f"{describe_ranks(ranks)} {have} waited {longest:.0f} s in {name}"
    else:
        waits = f"ranks have waited up to {longest:.0f} s in different collectives (" + "; ".join(
            f"{describe_ranks(ranks)} in {name}" for name, ranks in by_name.items()) + ")"
    if missing:
        groups: dict[str, list[int]] = {}
        for rank in missing:
            groups.setdefault(doing.get(rank, "running"), []).append(rank)
        absent = ", and ".join(
            f"{describe_ranks(ranks)} {_DOING.get(what, _DOING['running'])[len(ranks) > 1]}"
            for what, ranks in groups.items())
        waits = f"{waits}, while {absent}"
    return (f"ipydist stall warning: {waits}. A collective completes only when every rank calls "
            "it, in the same order. The stop button releases every rank; "
            "%%everyrank --timeout S does it by itself.")
