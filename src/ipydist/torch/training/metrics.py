"""``log()``: what a rank calls inside a training loop to stream metrics to the notebook.

Rank 0's values are the ones shown. Every rank also reports the time between its own
successive ``log()`` calls and how much of it was spent waiting in ipydist's collectives
(``waiting.take_waited``), so a straggler shows: in synchronous training every rank's step takes as
long as the slowest one's, but the slowest rank is the one that waits least.

Points are buffered and sent at most about ten times a second as an ipyparallel
``data_message`` on the rank's IOPub channel (signed with the cluster's key; no new port), and
whatever is left is sent when the cell ends. The sending is the rank's (``ipydist.rank.channel``),
handed in by the bootstrap (:func:`send_with`): torch/ never imports the rank side, and off an
ipydist rank (a plain script) points are batched and dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from ipydist.protocol import metrics_key
from ipydist.torch._core import waiting
from ipydist.torch.horovod.basics import rank
from ipydist.torch.horovod.collectives import allreduce
from ipydist.torch.training.batching import MetricBatcher

_batcher = MetricBatcher()


def _nowhere(key: str, value: object) -> None:
    """Off an ipydist rank there is no notebook to send to."""


#: Sends ``{key: value}`` to the notebook; nowhere until the rank's bootstrap hands one in.
_send: Callable[[str, object], None] = _nowhere
_last_call: float | None = None
#: Seconds between the last two calls in this cell (the cluster view's step time).
last_step_seconds: float | None = None
_next_step = 0
_is_rank0: bool | None = None  # a process's MPI rank never changes: asked once


def send_with(sender: Callable[[str, object], None]) -> None:
    """Send metric batches with ``sender(key, value)`` (the rank's data channel)."""
    global _send
    _send = sender


def log(step: int | None = None, total: int | None = None, reduce: str | None = None,
        batch_size: int | None = None, **metrics: float) -> None:
    """Record metrics for the live view, e.g. ``hvd.log(step=i, loss=loss.item())``.

    ``step``: the x coordinate (default: one more than the previous call's).
    ``total``: the number of steps expected, for the progress bar and ETA (steps count from 0,
    as ``range`` does). ``batch_size``: samples per step on each rank, for samples/s.
    ``reduce="mean"`` averages every value over the ranks first (a collective: every rank
    must call it); ``reduce="none"`` sends every rank's own values too, for the widget's
    per-rank curves (not a collective). Values must be plain numbers: pass ``loss.item()``.
    """
    log_values(metrics, step=step, total=total, reduce=reduce, batch_size=batch_size)


def log_values(metrics: Mapping[str, float], step: int | None = None,
               total: int | None = None, reduce: str | None = None,
               batch_size: int | None = None) -> None:
    """:func:`log` with the metrics as a mapping: what the framework integrations call, so
    that a metric a framework names ``step``, ``total``, ``reduce`` or ``batch_size`` is a
    metric like any other, never taken for one of these options."""
    global _last_call, _next_step, last_step_seconds
    now = time.monotonic()
    since_last = None if _last_call is None else now - _last_call
    _last_call = now
    if since_last is not None:
        last_step_seconds = since_last
    if reduce == "mean":
        metrics = _mean_over_ranks(dict(metrics))
    elif reduce not in (None, "none"):
        raise ValueError(f"hvd.log(reduce={reduce!r}): expected None, 'mean' or 'none'.")
    try:
        values = {name: float(v) for name, v in metrics.items()}
    except (TypeError, ValueError, RuntimeError):
        bad = [n for n, v in metrics.items() if not _is_number(v)]
        raise TypeError(
            f"hvd.log({', '.join(f'{n}=...' for n in bad)}): metric values must be single "
            "numbers (for a tensor, pass loss.item())."
        ) from None
    if step is None:
        step = _next_step
    _next_step = step + 1
    if total is not None:
        _batcher.total = total
    if batch_size is not None:
        _batcher.batch_size = batch_size
    if _is_rank0 is None:
        _first_call_setup()
    point = (step, time.time(), values) if _is_rank0 or reduce == "none" else None
    batch = _batcher.add(point, since_last, waiting.take_waited())
    if batch is not None:
        _send(metrics_key(batch["seq"]), batch)


def flush() -> None:
    """Send what was not sent yet; the next step's time starts with the next cell, and the
    next cell's ``total`` and ``batch_size`` are what it gives (none if it gives none)."""
    global _last_call
    _last_call = None
    waiting.take_waited()
    batch = _batcher.flush()
    _batcher.total = _batcher.batch_size = None
    if batch is not None:
        _send(metrics_key(batch["seq"]), batch)


def _is_number(v) -> bool:
    try:
        float(v)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _mean_over_ranks(metrics: dict) -> dict:
    names = sorted(metrics)
    values = allreduce(torch.tensor([float(metrics[n]) for n in names], dtype=torch.float64))
    return dict(zip(names, values.tolist()))


def _first_call_setup() -> None:
    """Learn this rank's number, and flush at the end of every cell from now on."""
    global _is_rank0
    _is_rank0 = rank() == 0
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.events.register("post_execute", flush)
