"""The live metrics widget: an anywidget whose front end is three plain ES files, joined in
order (no build step): ``numbers.js`` (the number formatter, shared rules with
``numbers.py``), ``chart.js`` (one chart: axes, curves, markers, hover, zoom) and ``widget.js``
(the panel: header, progress, controls, export).

While a cell runs, new points travel as custom messages (:meth:`MetricsWidget.append`), so
appending never resends the series. The synced traits are small during the run (``stats``,
``charts``) and take the final downsampled curves (``series``) when the cell ends, which is
what a saved notebook's widget state keeps, with the reader's ``settings``.

The chart plan is ``charts``, never ``layout``: every ipywidget's ``layout`` is a reference to
a ``Layout`` model that the front end builds a child view for, and a plain dict there made
JupyterLab throw (``reading 'then'`` in ``create_child_view``) each time a chart appeared.
Notebooks saved before the rename keep the old ``_esm`` and state they were saved with, so
the ipywidgets base view still reports that error once when they are reopened (re-running
the cell replaces it); the front end reads a dict with ``charts`` in ``layout`` as the plan
where it finds one, and ignores anything else there.
"""

from __future__ import annotations

import pathlib

import anywidget
import traitlets

from ipydist.notebook.live.static import summary_line

_HERE = pathlib.Path(__file__).parent
#: The front end's files, in the order they are joined; only the last one exports.
FRONT_END = ("numbers.js", "chart.js", "widget.js")


def front_end_source() -> str:
    return "\n".join((_HERE / name).read_text() for name in FRONT_END)


class MetricsWidget(anywidget.AnyWidget):
    _esm = front_end_source()
    _css = _HERE / "widget.css"

    #: Ties the widget to its static copy in the same output, which it hides when it renders.
    key = traitlets.Unicode("").tag(sync=True)
    #: Final curves, ``{name: [steps, values, seconds since the cell's first point]}``; empty
    #: while the cell runs. ``rank_series`` likewise, per rank, for ``reduce="none"``.
    series = traitlets.Dict().tag(sync=True)
    rank_series = traitlets.Dict().tag(sync=True)
    #: Latest values, rates, progress and the per-rank strip (see ``summary.summarize``).
    stats = traitlets.Dict().tag(sync=True)
    #: Which metric is on which chart, in which colour (see ``layout.chart_layout``). Not
    #: named ``layout``: that is ipywidgets' own trait (see the module docstring).
    charts = traitlets.Dict().tag(sync=True)
    #: The reader's choices: smoothing, log scale per chart, x axis, per-rank curves. Set by
    #: the front end; a new cell's widget starts with the last ones.
    settings = traitlets.Dict().tag(sync=True)
    done = traitlets.Bool(False).tag(sync=True)

    def __repr__(self) -> str:
        """The text/plain of the widget's output (a plain-text viewer, an untrusted page):
        the last values and how far the run got, as the header reads (updated when the cell
        ends: :meth:`LiveView.finish`)."""
        line = summary_line(self.stats) if self.stats else ""
        return f"ipydist live metrics: {line}" if line else "ipydist live metrics"

    def append(self, count: int, series: dict, rank_series: dict | None = None,
               start: int = 0) -> None:
        """Send new points: those after the cell's first ``start``, up to ``count``, how many
        it has logged in all (a page that caught up to a later count skips or trims them)."""
        self.send({"type": "append", "start": start, "count": count, "series": series,
                   "rank_series": rank_series or {}})
