"""Stall warnings: some ranks wait in a collective that others never entered.

A collective finishes only when every rank calls it. When one rank skips it (``if rank == 0:``),
calls another one, or is still busy, the others wait without a word, and the notebook just
shows a busy cell. Horovod's coordinator notices this and writes a warning to its log; ipydist
puts the same warning under the cell.

Each rank's watcher thread reports the collective call it has been in for a second
(:mod:`ipydist.rank.stack_sampler`, as ``protocol.STATE_KEY`` data messages). :class:`StallWatch`
collects those reports for the running cell and, once a rank has waited past the threshold,
names the ranks that are not in that collective and what they are doing instead. Pure logic,
tested without a cluster.
"""

from __future__ import annotations

from ipydist.specs import describe_ranks


class StallWatch:
    """Notebook side: what each rank of the running cell waits in, and when that is a stall."""

    def __init__(self, targets: list[int], threshold: float,
                 timeout_hint: str = "%%everyrank --timeout S"):
        self.targets = list(targets)
        self.threshold = threshold
        #: How the user makes a cell release itself, for the message.
        self.timeout_hint = timeout_hint
        #: rank -> (collective, since), in the notebook's monotonic clock
        self.waiting: dict[int, tuple[str, float]] = {}
        #: When which rank waits in what last changed: a situation younger than a report's
        #: interval may be stale (see :meth:`check`).
        self._changed = float("-inf")
        self._warned: set[tuple] = set()

    def accept(self, rank: int, state: dict, now: float) -> None:
        was = self.waiting.get(rank, (None,))[0]
        if state.get("collective"):
            self.waiting[rank] = (state["collective"], now - float(state.get("waited", 0.0)))
        else:
            self.waiting.pop(rank, None)
        if self.waiting.get(rank, (None,))[0] != was:
            self._changed = now

    def check(self, now: float, doing: dict[int, str]) -> str | None:
        """A warning to show now, or None. ``doing`` says what each rank not waiting is doing
        instead ("running", "finished" or "failed"); each situation is reported once, once it
        has held for SETTLE_SECONDS. A rank reports what it waits in once a second, so just
        after a change the others' reports may be stale: a late rank's peers, all through
        their collective but not yet replied, read as still waiting in it, and a warning named
        the first of them to finish as one that "finished the cell without calling it" (seen
        once in a full run). A rank whose cell ended waits in nothing."""
        finished = [r for r in self.waiting if doing.get(r) in ("finished", "failed")]
        for rank in finished:
            del self.waiting[rank]
            self._changed = now
        if not self.threshold or self.threshold <= 0 or not self.waiting:
            return None
        longest = now - min(since for _, since in self.waiting.values())
        if longest < self.threshold or now - self._changed < SETTLE_SECONDS:
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
        return _describe(by_name, missing, doing, longest, self.timeout_hint)


#: How long a situation holds before it is warned of: more than a rank's report interval.
SETTLE_SECONDS = 1.5

#: What a rank outside every collective is doing, as (one rank, several ranks).
_DOING = {
    "running": ("is still running other code", "are still running other code"),
    "finished": ("finished the cell without calling it", "finished the cell without calling it"),
    "failed": ("stopped with an error", "stopped with an error"),
}


def _describe(by_name: dict[str, list[int]], missing: list[int], doing: dict[int, str],
              longest: float, timeout_hint: str) -> str:
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
            f"it, in the same order. The stop button releases every rank; {timeout_hint} does "
            "it by itself.")
