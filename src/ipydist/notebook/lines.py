"""Ranks' printed lines, merged: a line every rank prints is shown once.

:class:`LineMerger` is pure logic: it buffers each rank's lines for a moment so that a line
every rank prints (``epoch 3 done``) is shown once as ``[all ranks]`` instead of N times.
"""

from __future__ import annotations

import time
from collections import deque

ALL = "all ranks"


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
        now = time.monotonic() if now is None else now
        key = (rank, stream)
        text = self._partial.pop(key, "") + text
        *complete, rest = text.split("\n")
        for line in complete:
            self._lines[key].append((now, line + "\n"))
        if rest:
            self._partial[key] = rest

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
            self._lines[key].append((float("-inf"), rest + "\n"))
        self._partial.clear()
        return self.ready(now=float("inf"))
