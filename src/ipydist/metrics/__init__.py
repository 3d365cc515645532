"""Training metrics: batched on the ranks, collected and downsampled in the notebook.

The pieces here are the transport-independent logic (issue 4 builds the rank-side ``log()``
and the live widget on them): :class:`MetricBatcher` throttles what a rank sends,
:class:`MetricHistory` reassembles it in order, and :func:`downsample` keeps long series small.
"""

from ipydist.metrics.batching import MetricBatcher
from ipydist.metrics.history import MetricHistory, downsample

__all__ = ["MetricBatcher", "MetricHistory", "downsample"]
