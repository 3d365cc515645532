"""Errors the notebook side raises, each naming the ranks involved and what to do next."""

from __future__ import annotations

from ipydist.specs import describe_ranks


class ClusterError(RuntimeError):
    """The cluster could not start, is not running, or stopped underneath us."""


class RankError(RuntimeError):
    """Code raised on one or more ranks.

    IPython shows :meth:`_render_traceback_` instead of the notebook-side traceback: a header
    naming the failing ranks, the first failing rank's own traceback, and the others' errors
    (once, when they are all the same).
    """

    def __init__(self, failures: dict, what: str = "the cell"):
        #: rank -> ipyparallel RemoteError (ename, evalue, traceback)
        self.failures = dict(sorted(failures.items()))
        self.ranks = list(self.failures)
        first = self.failures[self.ranks[0]]
        self.ename, self.evalue = first.ename, first.evalue
        super().__init__(
            f"{describe_ranks(self.ranks)} raised in {what}: {first.ename}: {first.evalue}"
        )

    def _render_traceback_(self) -> list[str]:
        first_rank = self.ranks[0]
        first = self.failures[first_rank]
        lines = [str(self), "", f"--- rank {first_rank} ---"]
        lines += (first.traceback or f"{first.ename}: {first.evalue}").splitlines()
        same = [r for r in self.ranks[1:] if _same_error(self.failures[r], first)]
        if same:
            lines += ["", f"({describe_ranks(same)}: the same {first.ename})"]
        for r in self.ranks[1:]:
            if r not in same:
                e = self.failures[r]
                lines += ["", f"--- rank {r} ---"]
                lines += (e.traceback or f"{e.ename}: {e.evalue}").splitlines()
        return lines


def _same_error(a, b) -> bool:
    return (a.ename, a.evalue) == (b.ename, b.evalue)


class CellTimeout(TimeoutError):
    """A cell ran past its ``--timeout``; the ranks still running were interrupted."""
