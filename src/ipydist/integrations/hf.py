"""``LiveMetrics``: a Hugging Face ``TrainerCallback`` that draws what a ``Trainer`` logs in
the live metrics widget under the cell, as ``hvd.log`` does for a loop written by hand::

    trainer = Trainer(..., callbacks=[LiveMetrics()])

Every number the Trainer logs (``loss``, ``grad_norm``, ``learning_rate``, ``eval_*``, ...)
becomes a point at the index of the step just taken (the Trainer's global step - 1: charts
count steps from 0), with ``max_steps`` as the progress bar's total; the
summary it logs once at the end (``train_runtime``, ``train_loss``, ...) is not drawn. The
Trainer calls a callback on every rank: each rank's call carries its step time, and rank 0's
points are drawn (as with ``hvd.log``). Runs on the ranks; imports transformers.
"""

from __future__ import annotations

from transformers import TrainerCallback

from ipydist.integrations import values as _values

#: What the Trainer logs once, when training ends: a summary, not a curve.
SUMMARY = ("train_runtime", "train_samples_per_second", "train_steps_per_second",
           "train_loss", "total_flos")


class LiveMetrics(TrainerCallback):
    """Sends what the Trainer logs to ``hvd.log``."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        from ipydist.torch.training.metrics import log_values

        numbers = _values.numbers({k: v for k, v in (logs or {}).items() if k not in SUMMARY})
        if numbers:
            total = state.max_steps if state.max_steps and state.max_steps > 0 else None
            # the Trainer counts the steps taken (1 after the first); a chart's x is the
            # index of the step, from 0 as hvd.log counts, so the last is total - 1
            # as a mapping: a metric named like one of log's options is still a metric
            log_values(numbers, step=max(state.global_step - 1, 0), total=total)
