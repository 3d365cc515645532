"""Notebook side of failure containment: release stuck ranks, then make the cluster usable.

A rank that raised leaves the others waiting in a collective that cannot complete; an
interrupted rank may be stuck the same way. A :class:`Release` sends each rank still running
the cell ``protocol.RELEASE_SIGNAL`` (``ipydist.rank.watcher`` on the rank turns it into a
KeyboardInterrupt in Python code, or breaks the connections of a collective), and once more a
second later for ranks still running. A signal only acts on a rank that is running the cell's
code, so a rank that has not begun the cell when released has its request cancelled, and is
signalled the moment it says it began, should the cancel come too late.

:func:`recover` then has every rank recover together (``ipydist.rank.calls.recover``): they
agree over MPI whether to rebuild the process group (a release broke it, or the ranks no
longer agree on how many collectives it ran), rebuild it, and put drifted tensors back in
step -- all of them or none, within deadlines, so nothing half-sent crosses into the next cell
and no rank is left waiting.
"""

from __future__ import annotations

import itertools

from ipydist import protocol
from ipydist.notebook import ipp
from ipydist.specs import describe_ranks

#: After a release, how long before a second one, which breaks communication regardless.
RELEASE_RETRY_SECONDS = 1.0
#: How long, after the first release, released ranks get to stop before the cell ends anyway.
STOP_WAIT_SECONDS = 8.0

#: Numbers recoveries, whose messages between ranks are tagged with it (see rank.consensus).
_recovery_numbers = itertools.count()


class Release:
    """Releases the ranks still running one cell: at most twice, the second time no sooner
    than RELEASE_RETRY_SECONDS after the first."""

    def __init__(self, cluster, async_result, targets: list[int]):
        self.cluster = cluster
        self.ar = async_result
        self.targets = targets
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None
        #: Every rank released so far.
        self.ranks: list[int] = []
        #: Ranks that said they began the cell's code (only those a signal can release).
        self.began: set[int] = set()
        #: Released before they began: their request was cancelled; signalled if they begin.
        self.before_start: set[int] = set()

    def due(self, now: float) -> bool:
        """Whether a (further) release may be sent now."""
        return self.count < 2 and (self.last is None or now >= self.last + RELEASE_RETRY_SECONDS)

    def send(self, ranks: list[int], now: float) -> None:
        begun = [r for r in ranks if r in self.began]
        if begun:
            self.cluster.signal(protocol.RELEASE_SIGNAL, begun)
        waiting = [r for r in ranks if r not in self.began and r not in self.before_start]
        if waiting:
            self.cluster.abort([ipp.msg_id(self.ar, self.targets, r) for r in waiting], waiting)
            self.before_start.update(waiting)
        self.ranks = sorted(set(self.ranks) | set(ranks))
        self.first = now if self.first is None else self.first
        self.last = now
        self.count += 1

    def rank_began(self, rank: int) -> None:
        """``rank`` said it began the cell's code: release it now if it was released before."""
        self.began.add(rank)
        if rank in self.before_start:
            self.before_start.discard(rank)
            self.cluster.signal(protocol.RELEASE_SIGNAL, [rank])

    def given_up(self, now: float) -> bool:
        """Whether released ranks had their time to stop (the cell then ends without them)."""
        return self.first is not None and now >= self.first + STOP_WAIT_SECONDS


def recover(cluster, released: list[int], restart: str) -> list[str]:
    """After a failed or interrupted cell, with every rank idle: what the released ranks were
    doing, and the ranks back in step. Returns lines for the cell's message; ``restart``
    names how the user starts a fresh cluster, should the recovery fail."""
    try:
        replies: list[protocol.RecoveryReport] = cluster.call(
            protocol.RECOVER, next(_recovery_numbers), bool(released),
            timeout=protocol.RECOVERY_WAIT_SECONDS)
    except Exception as e:  # a rank that died or hangs: its own report says more
        return [f"The ranks could not recover together ({e}): run {restart}."]
    notes = []
    doing: dict[str, list[int]] = {}  # what a released rank was doing -> those ranks
    for rank, reply in enumerate(replies):
        found = reply.release
        if found is not None and rank in released:
            doing.setdefault(_what_it_was_doing(found), []).append(rank)
    for what, who in doing.items():
        one = len(who) == 1
        if what == "ended":
            note = (f"{describe_ranks(who)} stopped by {'itself' if one else 'themselves'} as "
                    "the others were released.")
        else:
            verb = "was" if one else "were"
            note = f"{describe_ranks(who)} {verb} {what}, and {verb} released."
        notes.append(note[0].upper() + note[1:])
    failed = sorted({reply.failed for reply in replies if reply.failed})
    if failed:
        notes.append(f"Recovery gave up on every rank ({'; '.join(failed)}), so collectives "
                     f"will not work: run {restart}.")
        return notes
    if replies[0].rebuilt:
        notes.append("The process group was rebuilt on every rank, so collectives work in the "
                     f"next cell{holders_of_the_group(replies, 'it')}.")
    fixed = replies[0].fixed
    if fixed:
        notes.append(
            f"{fixed} parameter or optimizer-state tensor{'s' if fixed > 1 else ''} differed "
            "between ranks after the interruption; rank 0's values were copied to every rank."
        )
    return notes


def holders_of_the_group(replies, group: str) -> str:
    """What the ranks said of their models and meshes when the group was made again, as
    clauses of a line: the DDP models that now use ``group`` (as the line names it), and what
    must be made again (its next use says so too). Heals' and recoveries' replies alike."""
    text = ""
    if followed := sorted({name for reply in replies for name in reply.followed}):
        text += f"; DistributedDataParallel models moved onto {group}: {', '.join(followed)}"
    if marked := sorted({name for reply in replies for name in reply.marked}):
        text += f"; made over the old group, to be made again before use: {', '.join(marked)}"
    return text


def _what_it_was_doing(found: dict) -> str:
    if found.get("ended"):
        return "ended"
    return f"waiting in {found['what']}" if found["what"] else "running Python code"
