"""The live metrics widget: an anywidget whose front end is ``widget.js`` (no build step).

While a cell runs, new points travel as custom messages (:meth:`MetricsWidget.append`), so
appending never resends the series. The synced traits are small during the run (``stats``)
and take the final downsampled curves (``series``) when the cell ends, which is what a saved
notebook's widget state keeps.
"""

from __future__ import annotations

import pathlib

import anywidget
import traitlets

_HERE = pathlib.Path(__file__).parent


class MetricsWidget(anywidget.AnyWidget):
    _esm = _HERE / "widget.js"
    _css = _HERE / "widget.css"

    #: Ties the widget to its static copy in the same output, which it hides when it renders.
    key = traitlets.Unicode("").tag(sync=True)
    #: Final curves, ``{name: [steps, values]}``; empty while the cell runs.
    series = traitlets.Dict().tag(sync=True)
    #: Latest values, rates, progress and the per-rank strip (see ``summary.summarize``).
    stats = traitlets.Dict().tag(sync=True)
    done = traitlets.Bool(False).tag(sync=True)

    def __repr__(self) -> str:  # the text/plain of the widget's output, e.g. on GitHub
        return "ipydist live metrics"

    def append(self, count: int, series: dict[str, tuple[list, list]]) -> None:
        """Send new points; ``count`` is how many this cell has logged in all."""
        self.send({"type": "append", "count": count,
                   "series": {name: [xs, ys] for name, (xs, ys) in series.items()}})
