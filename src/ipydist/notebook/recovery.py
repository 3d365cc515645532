"""Notebook side of failure containment: release stuck ranks, then make the cluster usable.

A rank that raised leaves the others waiting in a collective that cannot complete; an
interrupted rank may be stuck the same way. A :class:`Release` sends each still-running rank
``protocol.RELEASE_SIGNAL`` (``ipydist.rank.watcher`` on the rank turns it into a
KeyboardInterrupt in Python code, or breaks the connections of a collective), and once more a
second later for ranks still running. :func:`recover` then asks every rank what it was doing,
and rebuilds the process group on all of them when a release broke it or when the ranks no
longer agree on how many collectives the group has run -- so nothing half-sent crosses into
the next cell.
"""

from __future__ import annotations

import time

from ipydist import protocol
from ipydist.notebook import ipp
from ipydist.specs import describe_ranks

#: After a release, how long before a second one, which breaks communication regardless.
RELEASE_RETRY_SECONDS = 1.0
#: How long an interrupt waits in all for the ranks to stop.
INTERRUPT_WAIT_SECONDS = 4.0


class Release:
    """Releases the ranks still running one cell: at most twice, the second time no sooner
    than RELEASE_RETRY_SECONDS after the first."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.count = 0
        self.last: float | None = None
        #: Every rank released so far.
        self.ranks: list[int] = []

    def due(self, now: float) -> bool:
        """Whether a (further) release may be sent now."""
        return self.count < 2 and (self.last is None or now >= self.last + RELEASE_RETRY_SECONDS)

    def send(self, ranks: list[int], now: float) -> None:
        self.cluster.signal(protocol.RELEASE_SIGNAL, ranks)
        self.ranks = sorted(set(self.ranks) | set(ranks))
        self.last = now
        self.count += 1


def interrupt(release: Release, ar, targets: list[int]) -> list[int]:
    """Stop the ranks still running the cell (Ctrl-C, ``--timeout``): release them, again a
    second later if any is still running, and wait a little for them."""
    running = ipp.still_running(ar, targets)
    if not running:
        return running
    release.send(running, time.monotonic())
    if not ar.wait(RELEASE_RETRY_SECONDS):
        release.send(ipp.still_running(ar, targets), time.monotonic())
        ar.wait(INTERRUPT_WAIT_SECONDS - RELEASE_RETRY_SECONDS)
    return running


def recover(cluster, released: list[int], restart: str) -> list[str]:
    """After a failed or interrupted cell: what the released ranks were doing, and a rebuilt
    process group where needed. Returns lines for the cell's message; ``restart`` names how
    the user starts a fresh cluster, should rebuilding fail."""
    try:
        states = cluster.call("state", timeout=10)
    except Exception as e:  # a rank that died or hangs: its own report says more
        return [f"could not check the ranks' process group afterwards: {e}"]
    notes = []
    doing: dict[str, list[int]] = {}  # what a released rank was doing -> those ranks
    for rank, state in enumerate(states):
        found = state["release"]
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
    seqs = {s["seq"] for s in states if s["seq"] is not None}
    if any(s["broken"] for s in states) or len(seqs) > 1:
        t0 = time.perf_counter()
        try:
            cluster.call("repair", timeout=120)
        except Exception as e:
            notes.append(f"Rebuilding the process group failed ({e}): run {restart}.")
            return notes
        note = (f"The process group was rebuilt on every rank in "
                f"{time.perf_counter() - t0:.1f} s, so collectives work in the next cell.")
        if any(s.get("ddp") for s in states):
            note += " Wrap your DistributedDataParallel model again: it keeps the old group."
        notes.append(note)
    if released:
        try:
            fixed = cluster.call("resync", timeout=120)[0]
        except Exception as e:
            notes.append(f"Checking that the ranks' models are still identical failed ({e}).")
        else:
            if fixed:
                notes.append(
                    f"{fixed} parameter or optimizer-state tensor{'s' if fixed > 1 else ''} "
                    "differed between ranks after the interruption; rank 0's values were "
                    "copied to every rank."
                )
    return notes


def _what_it_was_doing(found: dict) -> str:
    if found.get("ended"):
        return "ended"
    return f"waiting in {found['what']}" if found["what"] else "running Python code"
