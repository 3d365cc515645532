"""Notebook side of failure containment: release stuck ranks, then make the cluster usable.

A rank that raised leaves the others waiting in a collective that cannot complete; an
interrupted rank may be stuck the same way. :func:`release` sends each still-running rank the
release signal (``ipydist.release`` on the rank: a KeyboardInterrupt in Python code, broken
connections in a collective). :func:`recover` then asks every rank what it was doing, and
rebuilds the process group on all of them when a release broke it or when the ranks no longer
agree on how many collectives the group has run -- so nothing half-sent crosses into the next
cell.
"""

from __future__ import annotations

import time

from ipydist.specs import describe_ranks

#: After an interrupt, how long before a second release that breaks communication regardless.
INTERRUPT_RETRY_SECONDS = 1.0
#: How long an interrupt waits in all for the ranks to stop.
INTERRUPT_WAIT_SECONDS = 4.0


def release(session, ranks: list[int]) -> None:
    from ipydist.release import RELEASE_SIGNAL

    session.signal(RELEASE_SIGNAL, ranks)


def interrupt(session, ar, targets: list[int]) -> list[int]:
    """Stop the ranks still running the cell (Ctrl-C, ``--timeout``): release them, again a
    second later if any is still running, and wait a little for them."""
    running = [r for r, child in zip(targets, ar._children) if not child.done()]
    if not running:
        return running
    release(session, running)
    if not ar.wait(INTERRUPT_RETRY_SECONDS):
        still = [r for r, child in zip(targets, ar._children) if not child.done()]
        release(session, still)
        ar.wait(INTERRUPT_WAIT_SECONDS - INTERRUPT_RETRY_SECONDS)
    return running


def recover(session, released: list[int]) -> list[str]:
    """After a failed or interrupted cell: what the released ranks were doing, and a rebuilt
    process group where needed. Returns lines for the cell's message."""
    ranks = list(range(session.size))
    try:
        states = session._view(ranks).apply_async(_rank_state).get(timeout=10)
    except Exception as e:  # a rank that died or hangs: its own report says more
        return [f"could not check the ranks' process group afterwards: {e}"]
    notes = []
    doing: dict[str, list[int]] = {}  # what a released rank was doing -> those ranks
    for rank, state in zip(ranks, states):
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
            session._view(ranks).apply_async(_rank_repair).get(timeout=120)
        except Exception as e:
            notes.append(f"Rebuilding the process group failed ({e}): run %dist_restart.")
            return notes
        notes.append(
            f"The process group was rebuilt on every rank in {time.perf_counter() - t0:.1f} s, "
            "so collectives work in the next cell. Wrap a DistributedDataParallel model again: "
            "it keeps the old group."
        )
    if released:
        try:
            fixed = session._view(ranks).apply_async(_rank_resync).get(timeout=120)[0]
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


# Sent to the ranks by value (ipyparallel pickles functions' code), so they import what they use.
def _rank_state():
    from ipydist import release
    from ipydist.torch import consistency

    consistency.abandon_pending()  # the failed cell's half-done gradient averaging is void
    return release.state()


def _rank_resync():
    from ipydist.torch import consistency

    return consistency.resync()


def _rank_repair():
    from ipydist import release

    release.repair()
