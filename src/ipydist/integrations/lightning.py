"""``LiveLogger``: a Lightning logger that draws what a ``Trainer`` logs in the live metrics
widget under the cell, as ``hvd.log`` does for a loop written by hand::

    trainer = L.Trainer(..., logger=LiveLogger())

Every value a ``LightningModule`` logs with ``self.log`` (training and validation) becomes a
point at the trainer's global step. Lightning calls a logger on every rank (its own loggers
then write on rank 0 only): here each rank's call carries its step time, and rank 0's points
are drawn, as with ``hvd.log``. Runs on the ranks; imports Lightning.
"""

from __future__ import annotations

from lightning.pytorch.loggers.logger import Logger

from ipydist.integrations import values as _values


class LiveLogger(Logger):
    """Sends what Lightning logs to ``hvd.log``; ``total`` (optional): the number of steps,
    for the progress bar and ETA (a logger is not told how long the fit will be)."""

    def __init__(self, total: int | None = None):
        super().__init__()
        self._total = total
        self._trainer = None

    @property
    def name(self) -> str:
        return "ipydist"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """Hyperparameters are not drawn."""

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        from ipydist.torch.training.metrics import log_values

        numbers = _values.numbers(metrics)
        if numbers:
            # as a mapping: a metric named like one of log's options is still a metric
            log_values(numbers, step=step, total=self._total)

