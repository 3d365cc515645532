"""The errors users meet, each naming the ranks involved and what to do next; every one is an
:class:`IpydistError`.

Bad input the user typed is a :class:`~ipydist.specs.SpecError` (raised where it is parsed).
The magics show an error as ``UsageError: <message>`` unless it shows itself
(:meth:`_render_traceback_`: a rank's traceback, or a message that names the ranks)."""

from __future__ import annotations

import textwrap

from ipydist.error_base import IpydistError
from ipydist.specs import SpecError, describe_ranks

__all__ = ["CellInterrupted", "CellTimeout", "ClusterError", "InvalidArgument", "IpydistError",
           "LaunchError",
           "NotDefined", "RankDied", "RankError", "RankTimeout", "ReplyLost", "SpecError",
           "shows_itself"]

#: Messages are wrapped at spaces to this width: a notebook breaks a long output line wherever
#: the output area ends, inside words ("mpiexe|c then stopped").
MESSAGE_WIDTH = 88


def wrap_message(text: str, width: int = MESSAGE_WIDTH) -> list[str]:
    """``text`` as lines of at most ``width`` characters, broken at spaces only (a path or
    a long name stays whole); its own line breaks are kept."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        lines += textwrap.wrap(paragraph, width, break_long_words=False,
                               break_on_hyphens=False) or [""]
    return lines


class _OneMessage:
    """An error shown as its message alone, wrapped (no notebook-side traceback: the message
    says which ranks, what happened and what to do)."""

    def _render_traceback_(self) -> list[str]:
        return wrap_message(f"{type(self).__name__}: {self}")


class LaunchError(IpydistError, ValueError):
    """The launch cannot work as asked (no mpiexec, GPUs that are not there); the message says
    what to do. Raised in the notebook, or by a rank's bootstrap, which prints it."""


class InvalidArgument(IpydistError, ValueError):
    """A call inside a cell (``hvd.allreduce(...)``, ``DistributedOptimizer(...)``) was given
    an argument that cannot work there; the message says what to pass instead."""


class ClusterError(IpydistError, RuntimeError):
    """The cluster could not start, is not running, or stopped underneath us."""


class RankDied(_OneMessage, ClusterError):
    """A rank's process is gone (killed, crashed); the cluster must be restarted. Shown as
    its message alone (which rank, how it died, what to run), not a usage error."""


class ReplyLost(_OneMessage, ClusterError):
    """A rank ended the cell, but its reply never reached the notebook; the rank is idle and
    the cluster usable. The message alone: which rank, and that running the cell again is safe."""


class RankTimeout(IpydistError, TimeoutError):
    """Ranks did not answer a request of the notebook (the debugger's, the timeline's) in
    time, usually because a cell is still running there; the message names them."""


class NotDefined(IpydistError, NameError):
    """A variable asked for by name (``%dist_pull``, ``%dist_push``) is not defined where it
    was looked for; the message says where."""


class RankError(IpydistError, RuntimeError):
    """Code raised on one or more ranks.

    IPython shows :meth:`_render_traceback_` instead of the notebook-side traceback: a header
    naming the failing ranks, the first failing rank's own traceback, and the others' errors
    (once, when they are all the same).
    """

    def __init__(self, failures: dict, what: str = "the cell", first: int | None = None,
                 released: list[int] | None = None, notes: list[str] | None = None):
        #: rank -> ipyparallel RemoteError (ename, evalue, traceback)
        self.failures = dict(sorted(failures.items()))
        #: The rank that failed first (its traceback is shown), then the others in order.
        self.ranks = sorted(self.failures, key=lambda r: (r != first, r))
        #: Ranks released because of the failure: their errors are a consequence, not a cause.
        self.released = sorted(released or [])
        self.notes = list(notes or [])
        causes = [r for r in self.ranks if r not in self.released] or self.ranks
        self.ranks = causes + [r for r in self.ranks if r not in causes]
        first_error = self.failures[self.ranks[0]]
        self.ename, self.evalue = first_error.ename, first_error.evalue
        super().__init__(
            f"{describe_ranks(causes)} raised in {what}: {first_error.ename}: "
            f"{first_error.evalue}"
            + "".join(f"\n{note}" for note in self.notes)
        )

    def _render_traceback_(self) -> list[str]:
        first_rank = self.ranks[0]
        first = self.failures[first_rank]
        lines = [*wrap_message(str(self)), "", f"--- rank {first_rank} ---"]
        lines += (first.traceback or f"{first.ename}: {first.evalue}").splitlines()
        others = [r for r in self.ranks[1:] if r not in self.released]
        same = [r for r in others if _same_error(self.failures[r], first)]
        if same:
            lines += ["", f"({describe_ranks(same)}: the same {first.ename})"]
        for r in others:
            if r not in same:
                e = self.failures[r]
                lines += ["", f"--- rank {r} ---"]
                lines += (e.traceback or f"{e.ename}: {e.evalue}").splitlines()
        return lines


def _same_error(a, b) -> bool:
    return (a.ename, a.evalue) == (b.ename, b.evalue)


class CellTimeout(_OneMessage, IpydistError, TimeoutError):
    """A cell ran past its ``--timeout``; the ranks still running were interrupted."""


class CellInterrupted(_OneMessage, KeyboardInterrupt):
    """The user interrupted a cell (the stop button, Ctrl-C); the message says which ranks
    were interrupted and what recovery did. An interrupt, not an error: it stays a
    ``KeyboardInterrupt`` (not an :class:`IpydistError`), so ``except Exception`` in a
    notebook never swallows a stop."""


def shows_itself(error: BaseException) -> bool:
    """Whether ``error`` renders its own output in IPython (a rank's traceback, a message that
    names the ranks), rather than being shown as a usage error."""
    return hasattr(error, "_render_traceback_")
