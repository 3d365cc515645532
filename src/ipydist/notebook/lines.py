"""Ranks' printed lines, merged: a line every rank prints is shown once.

:class:`LineMerger` is pure logic: it buffers each rank's lines for a moment so that a line
every rank prints (``epoch 3 done``) is shown once as ``[all ranks]`` instead of N times.
"""

from __future__ import annotations

import re
import time
from collections import deque

ALL = "all ranks"
_LINE_END = re.compile(r"(\r\n|\n|\r)")


class LineMerger:
    """Buffers each rank's stream text and hands out tagged lines when they are ready.

    A complete line that is at the head of every rank's buffer, and identical on all of them,
    is ready once with the tag ``"all ranks"``. Any other line is ready with its rank's tag
    once it has waited ``hold`` seconds (or at :meth:`flush`), so nothing is held back long.
    """

    def __init__(self, ranks: list[int], hold: float = 0.25):
        self.ranks = list(ranks)
        self.hold = hold
        self._partial: dict[tuple[int, str], str] = {}
        self._lines: dict[tuple[int, str], deque[tuple[float, str]]] = {
            (r, s): deque() for r in self.ranks for s in ("stdout", "stderr")
        }

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
                self._lines[key].append((now, line + "\n"))
            elif line:  # an empty state between two redraws shows nothing
                self._lines[key].append((now, line + "\r"))
        if parts[-1] or held:
            self._partial[key] = parts[-1] + held

    def ready(self, now: float | None = None) -> list[tuple[str, str, str]]:
        """Lines ready to show now, as (tag, stream, line)."""
        now = time.monotonic() if now is None else now
        out: list[tuple[str, str, str]] = []
        for stream in ("stdout", "stderr"):
            queues = [self._lines[(r, stream)] for r in self.ranks]
            while True:
                if len(self.ranks) > 1 and all(queues):
                    heads = {q[0][1] for q in queues}
                    if len(heads) == 1:
                        out.append((ALL, stream, queues[0][0][1]))
                        for q in queues:
                            q.popleft()
                        continue
                any_ready = False
                for r, q in zip(self.ranks, queues):
                    if q and now - q[0][0] >= self.hold:
                        out.append((f"rank {r}", stream, q.popleft()[1]))
                        any_ready = True
                if not any_ready:
                    break
        return out

    def flush(self) -> list[tuple[str, str, str]]:
        """Everything still buffered, partial lines included (the cell has ended)."""
        for key, rest in list(self._partial.items()):
            rest = rest.rstrip("\r")
            if rest:
                self._lines[key].append((float("-inf"), rest + "\n"))
        self._partial.clear()
        return self.ready(now=float("inf"))
