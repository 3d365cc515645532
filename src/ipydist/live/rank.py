"""``log()``: what a rank calls inside a training loop to stream metrics to the notebook.

Rank 0's values are the ones shown; every rank also reports the time between its own
successive ``log()`` calls, so a straggler shows. Points are buffered and sent at most about
ten times a second as an ipyparallel ``data_message`` on the rank's IOPub channel (signed with
the cluster's key; no new port), and whatever is left is sent when the cell ends.
"""

from __future__ import annotations

import time

from ipydist.live.batching import DATA_KEY, MetricBatcher

_batcher = MetricBatcher()
_last_call: float | None = None
_hooked = False


def log(step: int | None = None, total: int | None = None, reduce: str | None = None,
        **metrics: float) -> None:
    """Record metrics for the live view, e.g. ``hvd.log(step=i, loss=loss.item(), acc=acc)``.

    ``total``: the number of steps expected, for progress and ETA. ``reduce="mean"``
    averages every value over the ranks first (a collective: every rank must call it).
    """
    global _last_call
    now = time.monotonic()
    gap, _last_call = (None if _last_call is None else now - _last_call), now
    from ipydist.torch.collectives import rank

    if reduce == "mean":
        metrics = _mean_over_ranks(metrics)
    elif reduce is not None:
        raise ValueError(f"reduce={reduce!r}: expected None or 'mean'")
    point = {"step": step, "time": time.time(), "gap": gap}
    if total is not None:
        point["total"] = total
    if rank() == 0:
        point.update(metrics)
    _ensure_flush_at_cell_end()
    batch = _batcher.add(point)
    if batch is not None:
        _publish(batch)


def flush() -> None:
    """Send the points not sent yet (runs by itself when a cell ends)."""
    batch = _batcher.flush()
    if batch is not None:
        _publish(batch)


def _mean_over_ranks(metrics: dict) -> dict:
    import torch

    from ipydist.torch.collectives import allreduce

    names = sorted(metrics)
    values = allreduce(torch.tensor([float(metrics[n]) for n in names], dtype=torch.float64))
    return dict(zip(names, values.tolist()))


def _publish(batch: dict) -> None:
    try:
        from ipyparallel.datapub import publish_data
    except ImportError:  # not on an ipyparallel engine: nothing to send to
        return
    try:
        publish_data({DATA_KEY: batch})
    except Exception:  # outside an engine's shell (a plain script under mpiexec)
        pass


def _ensure_flush_at_cell_end() -> None:
    global _hooked
    if _hooked:
        return
    _hooked = True
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.events.register("post_execute", flush)
