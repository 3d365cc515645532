"""Ranks' rich output (``display()``, matplotlib figures, HTML): which to show, tagged how.

Pure logic; :mod:`ipydist.notebook.cell` does the showing. As ipyparallel's ``%%px`` does, every
shown rank's displays reach the notebook, each labelled by the rank that made it, so that
``if hvd.rank() == 1: plt.show()`` is not lost. Two rules keep that readable:

- The first shown rank's displays carry no tag (the usual ``if hvd.rank() == 0: display(...)``
  reads like any notebook output); another rank's is preceded by a ``[rank N]`` tag line.
- A bundle several ranks display alike (``plt.show()`` of an allreduced curve on every rank) is
  shown once per cell. Its tag names the ranks that displayed it, unless the first rank is among
  them: then the display *is* the first rank's and needs no tag. Whether a copy arrived first,
  merged, or late (its rank lagged) the outcome is the same; a tag already shown is updated.

A widget (``tqdm.notebook``, an ipywidget made on a rank) cannot be drawn here: its model lives in
the rank's kernel, so the notebook would say "model not found". Its view is dropped; what else
its bundle holds is shown; a widget with nothing else (its text is only its repr when made) is
named once under the cell, with what to do instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ipydist.notebook.output.lines import ALL
from ipydist.specs import describe_ranks

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: How much of a widget's text the note under the cell quotes, and how many widgets it names.
WIDGET_TEXT_CHARS = 60
WIDGETS_NAMED = 3


class Display:
    """One display_data bundle from one rank. Equal (and hashed) by its data alone, so that
    :class:`~ipydist.notebook.output.lines.LineMerger` merges a bundle every rank displayed
    alike."""

    __slots__ = ("rank", "data", "metadata", "key")

    def __init__(self, rank: int, data: dict, metadata: dict | None = None):
        self.rank = rank
        self.data = data
        self.metadata = metadata or {}
        text = json.dumps(data, sort_keys=True, default=str)
        self.key = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, Display) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Display(rank={self.rank}, mimes={sorted(self.data)})"


@dataclass
class Shown:
    """A bundle shown in this cell: the ranks that displayed it, its tag line (None: no tag),
    and the handle :mod:`~ipydist.notebook.cell` keeps to change that line."""

    ranks: set[int]
    tag: str | None
    handle: object = None


@dataclass
class Step:
    """What to do with a display the merger released: ``"show"`` it (after ``shown.tag``),
    ``"retag"`` the copy shown earlier (its tag changed to ``shown.tag``), or ``"skip"`` it."""

    kind: str
    shown: Shown


@dataclass
class DisplayBook:
    """One cell's displays: decides each one's tag, shows a bundle once, collects widgets."""

    ranks: list[int]
    _shown: dict[str, Shown] = field(default_factory=dict)
    _widgets: dict[int, list[str]] = field(default_factory=dict)

    def take(self, rank: int, content: dict) -> Display | None:
        """A rank's display_data message as a :class:`Display` to queue, or None: nothing to
        show (a widget with nothing but its repr is kept for :meth:`note`)."""
        data = dict(content.get("data") or {})
        widget = data.pop(WIDGET_MIME, None) is not None
        if widget and set(data) <= {"text/plain"}:
            text = " ".join(data.get("text/plain", "").split())
            self._widgets.setdefault(rank, []).append(text)
            return None
        if not data:
            return None
        metadata = {k: v for k, v in (content.get("metadata") or {}).items() if k != WIDGET_MIME}
        return Display(rank, data, metadata)

    def accept(self, tag: str, display: Display) -> Step:
        """The merger released ``display`` as ``tag`` (``ALL``: every shown rank alike)."""
        ranks = set(self.ranks) if tag == ALL else {display.rank}
        shown = self._shown.get(display.key)
        if shown is None:
            shown = self._shown[display.key] = Shown(ranks, self.tag_for(ranks))
            return Step("show", shown)
        before = shown.tag
        shown.ranks |= ranks
        shown.tag = self.tag_for(shown.ranks)
        return Step("skip" if shown.tag == before else "retag", shown)

    def tag_for(self, ranks: set[int]) -> str | None:
        """``[rank N]`` / ``[ranks 1-3]``; None when the first shown rank displayed it too."""
        if self.ranks[0] in ranks:
            return None
        return f"[{describe_ranks(ranks)}]"

    def note(self) -> str | None:
        """Once under the cell: which ranks displayed widgets, why they are not shown, and what
        to do instead; None if none did."""
        if not self._widgets:
            return None
        texts = list(dict.fromkeys(t for ts in self._widgets.values() for t in ts if t))
        named = [t if len(t) <= WIDGET_TEXT_CHARS else t[:WIDGET_TEXT_CHARS - 3] + "..."
                 for t in texts[:WIDGETS_NAMED]]
        if len(texts) > WIDGETS_NAMED:
            named.append("...")
        count = sum(len(ts) for ts in self._widgets.values())
        what = "a widget" if count == 1 else f"{count} widgets"
        if named:
            what += f" ({', '.join(named)})"
        return (
            f"ipydist: {describe_ranks(self._widgets)} displayed {what}, which the notebook "
            "cannot show: a widget lives in the kernel that made it, here the rank's. Print or "
            "display() plain values instead, or %dist_pull them and make the widget in the "
            "notebook. For a progress bar use tqdm.auto or `from tqdm import tqdm`: on a rank "
            "they draw a text bar, shown tagged by rank.")
