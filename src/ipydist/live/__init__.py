"""Live training metrics: ``log()`` on the ranks, history (and the widget) in the notebook.

:class:`MetricBatcher` throttles what a rank sends, :class:`MetricHistory` reassembles it in
order on the notebook side, and :func:`downsample` keeps long series small for display. (The
package is not called ``metrics`` because ``ipydist.metrics()`` is the user's function.)
"""

from ipydist.live.batching import DATA_KEY, MetricBatcher
from ipydist.live.history import MetricHistory, downsample

__all__ = ["DATA_KEY", "MetricBatcher", "MetricHistory", "downsample"]
