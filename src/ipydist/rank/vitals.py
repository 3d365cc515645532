"""What a rank tells the cluster view while its cell runs, once a second: what it does (in a
collective, and for how long; at a breakpoint; running), its CPU use and memory, its GPU's
use and memory where NVML is there, and its last step time from ``hvd.log()``.

The watcher thread (:mod:`ipydist.rank.watcher`) samples the main thread's stack twice a
second anyway; every other sample it also takes these vitals and sends them as one small data
message (``protocol.VITALS_KEY``), one way: the notebook never asks, so a view costs the ranks
no round trip. Nothing is sent between cells (the notebook knows an idle rank is idle). Every
reading is of this process's own counters (``os.times``, ``/proc/self/statm``), and NVML's
(the ``nvidia-ml-py`` package, looked for once; nothing on a host without it or a GPU).
"""

from __future__ import annotations

import os
import sys
import time

#: Seconds between two vitals messages while a cell runs.
VITALS_SECONDS = 1.0
#: Where ``hvd.log()`` keeps the time between its last two calls (read, never imported: the
#: watcher starts before torch, and a rank that never logs has no step time).
_METRICS_MODULE = "ipydist.torch.training.metrics"

#: False turns the messages off (the benchmark's third variant).
enabled = True


class Vitals:
    def __init__(self) -> None:
        self._cpu_at = (time.monotonic(), _cpu_seconds())
        self._gpu = _NOT_LOOKED
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def sample(self, state: dict) -> dict:
        """``state`` (what the main thread does, from the sampler) with this rank's readings."""
        now, cpu = time.monotonic(), _cpu_seconds()
        then, cpu_then = self._cpu_at
        self._cpu_at = (now, cpu)
        # the first sample of a cell would average over the idle time before it: no reading
        share = None if now - then > 2.5 * VITALS_SECONDS else round(
            100.0 * (cpu - cpu_then) / max(now - then, 1e-6), 1)
        found = {**state, "cpu": share,
                 "rss": self._rss(), "step": _step_seconds(), "time": time.time()}
        if (gpu := self._gpu_reading()) is not None:
            found["gpu"] = gpu
        return found

    def _rss(self) -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def _gpu_reading(self) -> dict | None:
        if self._gpu is _NOT_LOOKED:
            self._gpu = _nvml_handle()
        if self._gpu is None:
            return None
        try:
            import pynvml

            use = pynvml.nvmlDeviceGetUtilizationRates(self._gpu)
            memory = pynvml.nvmlDeviceGetMemoryInfo(self._gpu)
            return {"util": int(use.gpu), "used": int(memory.used), "total": int(memory.total)}
        except Exception:
            return None


_NOT_LOOKED = object()


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _step_seconds() -> float | None:
    metrics = sys.modules.get(_METRICS_MODULE)
    return getattr(metrics, "last_step_seconds", None) if metrics is not None else None


def _nvml_handle():
    """NVML's handle of this rank's GPU (the first that ``CUDA_VISIBLE_DEVICES`` names), or
    None without NVML or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        if first.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(first))
        return pynvml.nvmlDeviceGetHandleByUUID(first)
    except Exception:
        return None
