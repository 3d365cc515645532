"""Ranks' printed lines, merged: a line every rank prints is shown once.

:class:`LineMerger` is pure logic: it buffers each rank's lines for a moment so that a line
every rank prints (``epoch 3 done``) is shown once as ``[all ranks]`` instead of N times. A
rank's displays (:class:`~ipydist.notebook.output.rich.Display`) pass through it too, so that
each comes out between what its rank printed before and after it, and so that one every rank
made alike merges the same way. What one rank printed comes out in the order it printed it,
stdout and stderr together.

A text progress bar (tqdm, or anything redrawing a line with ``\r``) comes out as
:class:`Redraw` lines: never merged (the ranks' bars differ in their rates and times, and a
merged state would be a copy left behind once they part), never held, and its last state
marked, so that the notebook can draw each rank's bar as one line updated in place.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import deque

ALL = "all ranks"
#: How long a line waits for the other ranks' copies on an idle machine. A rank's lines come in
#: batches (ipykernel sends what it printed every 0.2 s), so the ranks' copies of a line arrive
#: together unless a rank waited for a CPU: on a loaded machine they come further apart.
HOLD_SECONDS = 0.25
#: The most a line waits, however loaded the machine.
MAX_HOLD_SECONDS = 1.0
STREAMS = ("stdout", "stderr")
#: The "stream" of a display that :meth:`LineMerger.ready` hands out.
DISPLAY = "display"
_LINE_END = re.compile(r"(\r\n|\n|\r)")
#: What Open MPI's nonblocking collectives print when a rank they wait for died (ULFM).
_MPI_NOISE = re.compile(r"NBC_Progress: an error \d+ was found during schedule")


class Redraw(str):
    """One state of a rank's text progress bar: the text, ending in ``\r`` while the bar is
    redrawn, or in ``\n`` for its last state (``last``: the line that ended the bar)."""

    last: bool = False

    @classmethod
    def final(cls, text: str) -> Redraw:
        line = cls(text)
        line.last = True
        return line


def hold_for_load(load: float, cpus: int) -> float:
    """How long a line waits for the other ranks' copies, given the machine's load (runnable
    processes, averaged over a minute) and its CPUs: :data:`HOLD_SECONDS` while each CPU has
    one process to run, as many times longer as each has more (the ranks' copies of a line come
    apart by how long each waits to be scheduled), at most :data:`MAX_HOLD_SECONDS`."""
    return min(MAX_HOLD_SECONDS, HOLD_SECONDS * max(1.0, load / max(1, cpus)))


#: How long a cell's first output waits for its first metric point (see :class:`FirstLines`).
FIRST_POINT_SECONDS = 0.5


class FirstLines:
    """Holds a cell's first output, at most :data:`FIRST_POINT_SECONDS`, until its first metric
    point, so that the live chart, which opens with that point, sits above the lines: a
    training loop prints and logs in the same step, the printed line travels first, and the
    chart opened between the first line and the rest. Once released (the chart open, the time
    up, or a flush), it holds nothing again."""

    def __init__(self, seconds: float = FIRST_POINT_SECONDS) -> None:
        self.seconds = seconds
        self.over = False
        self._held: list = []
        self._since: float | None = None

    def take(self, released: list, charted: bool, now: float, hold: bool = True) -> list:
        """What to show now of ``released`` (and of what was held before it)."""
        if self.over:
            return released
        waited = self._since is not None and now - self._since >= self.seconds
        if charted or not hold or waited:
            self.over = True
            out, self._held = self._held + released, []
            return out
        if released and self._since is None:
            self._since = now
        self._held.extend(released)
        return []


class LineMerger:
    """Buffers each rank's stream text and hands out tagged lines when they are ready.

    A complete line that is at the head of every rank's buffer, and identical on all of them,
    is ready once with the tag ``"all ranks"``. Any other line is ready with its rank's tag
    once it has waited ``hold`` seconds (or at :meth:`flush`), so nothing is held back long.

    Displays (:meth:`put`) wait and merge alike, in a queue of their own so that one rank's
    display never keeps the other ranks' lines from merging, with two rules of order per rank:
    a display waits for the lines its rank printed before it, and a line printed after it sends
    it out at once (a display a line waits on goes out without merging; the display book
    recognises a later copy: see :mod:`ipydist.notebook.output.rich`).
    """

    def __init__(self, ranks: list[int], hold: float = HOLD_SECONDS):
        self.ranks = list(ranks)
        self.hold = hold
        self._partial: dict[tuple[int, str], str] = {}
        # entries are (arrival time, order of arrival, line or display)
        self._lines: dict[tuple[int, str], deque[tuple[float, int, object]]] = {
            (r, s): deque() for r in self.ranks for s in STREAMS
        }
        self._displays: dict[int, deque[tuple[float, int, object]]] = {
            r: deque() for r in self.ranks}
        self._order = itertools.count()
        #: (rank, stream) whose last line was a redraw: the next line ends that bar
        self._in_bar: set[tuple[int, str]] = set()
        #: (rank, stream) whose last line was MPI's noise (see ``_end_line``)
        self._after_noise: set[tuple[int, str]] = set()

    def feed(self, rank: int, stream: str, text: str, now: float | None = None) -> None:
        """Take ``text`` from a rank's stream. A line ends at ``\n``, or at ``\r`` (a text
        progress bar redrawing itself: each state becomes a line of its own, ending in
        ``\r`` so the next one overwrites it, tag included)."""
        now = time.monotonic() if now is None else now
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        if text.endswith("\r"):  # maybe the first half of a "\r\n": wait for what follows
            text, held = text[:-1], "\r"
        else:
            held = ""
        parts = _LINE_END.split(text)  # line, its end, line, its end, ..., the unfinished rest
        for line, end in zip(parts[0:-1:2], parts[1:-1:2]):
            if end != "\r":
                self._end_line(key, now, line)
            elif line.strip():  # an empty or blank state between two redraws shows nothing
                self._add(self._lines[key], now, Redraw(line + "\r"))
                self._in_bar.add(key)
        if parts[-1] or held:
            self._partial[key] = parts[-1] + held

    def _end_line(self, key: tuple[int, str], now: float, line: str) -> None:
        """A line ended by ``\n``: after redraws, the bar's last state. MPI's own report of a
        nonblocking collective a dead rank ended (``--elastic``) is left out, and the blank
        line it ends with: the cell's message says which rank died."""
        if _MPI_NOISE.match(line):
            self._after_noise.add(key)
            return
        if key in self._after_noise:
            self._after_noise.discard(key)
            if not line.strip():
                return
        if key in self._in_bar:
            self._in_bar.discard(key)
            self._add(self._lines[key], now, Redraw.final(line + "\n"))
        else:
            self._add(self._lines[key], now, line + "\n")

    def put(self, rank: int, display, now: float | None = None) -> None:
        """Take a display (hashable, equal to another rank's alike) after what ``rank`` printed
        so far. It ends the rank's unfinished lines, as a display does in a notebook."""
        now = time.monotonic() if now is None else now
        for stream in STREAMS:
            rest = self._partial.pop((rank, stream), "").rstrip("\r")
            if rest:
                self._end_line((rank, stream), now, rest)
        self._add(self._displays[rank], now, display)

    def ready(self, now: float | None = None) -> list[tuple[str, str, object]]:
        """Lines ready to show now, as (tag, stream, line); a display as (tag, DISPLAY, it)."""
        now = time.monotonic() if now is None else now
        out: list[tuple[str, str, object]] = []
        while True:  # again while one queue's output lets another's go
            before = len(out)
            for stream in STREAMS:
                self._ready([self._lines[(r, stream)] for r in self.ranks], stream, now, out)
            self._ready([self._displays[r] for r in self.ranks], DISPLAY, now, out)
            if len(out) == before:
                return out

    def flush(self) -> list[tuple[str, str, object]]:
        """Everything still buffered, partial lines included (the cell has ended)."""
        for key, rest in list(self._partial.items()):
            rest = rest.rstrip("\r")
            if rest:
                self._end_line(key, float("-inf"), rest)
        self._partial.clear()
        return self.ready(now=float("inf"))

    def _add(self, queue: deque, now: float, what) -> None:
        queue.append((now, next(self._order), what))

    def _ready(self, queues: list[deque], stream: str, now: float, out: list) -> None:
        """Hand out what is ready in one kind of queue (one per rank), in order."""
        while True:
            if len(self.ranks) > 1 and all(queues) and not any(
                    self._waits(r, q[0]) for r, q in zip(self.ranks, queues)):
                heads = {q[0][2] for q in queues}
                if len(heads) == 1 and not isinstance(queues[0][0][2], Redraw):
                    out.append((ALL, stream, queues[0][0][2]))
                    for q in queues:
                        q.popleft()
                    continue
            any_ready = False
            for r, q in zip(self.ranks, queues):
                if q and not self._waits(r, q[0]) and (
                        now - q[0][0] >= self.hold or isinstance(q[0][2], Redraw)
                        or self._due(r, q[0])):
                    out.append((f"rank {r}", stream, q.popleft()[2]))
                    any_ready = True
            if not any_ready:
                return

    def _waits(self, rank: int, entry) -> bool:
        """Whether ``entry`` must wait for something its rank sent before it: for a display,
        a line; for a line, a display or a line on the other stream."""
        _, order, what = entry
        queues = [self._lines[(rank, s)] for s in STREAMS]  # a line's own is never earlier
        if isinstance(what, str):
            queues.append(self._displays[rank])
        return any(q and q[0][1] < order for q in queues)

    def _due(self, rank: int, entry) -> bool:
        """Whether a display must go now: a line its rank printed after it waits on it."""
        _, order, what = entry
        return not isinstance(what, str) and any(
            q and q[-1][1] > order for q in (self._lines[(rank, s)] for s in STREAMS))
