"""The functions the notebook runs on every rank, by name, through
:func:`ipydist.protocol.on_rank` (so the kernel never imports this module, nor torch).

Each is a small question or repair: what the rank is, what a release found, rebuild the
process group, put drifted tensors back in step.
"""

from __future__ import annotations

import gc
import os
import socket

import torch.distributed as dist
from IPython import get_ipython
from torch.nn.parallel import DistributedDataParallel

from ipydist.rank import watcher
from ipydist.torch import consistency, runtime


def attach() -> dict:
    """Right after the ranks register: follow the engine's cells (see ``watcher.attach``), and
    say what this rank is, for the table the notebook shows."""
    watcher.attach(get_ipython())
    return info()


def info() -> dict:
    """What the notebook shows about this rank."""
    rt = runtime.get()
    nanny_pid = None
    try:
        from ipyparallel.engine.app import IPEngine

        if IPEngine.initialized() and getattr(IPEngine.instance(), "nanny_pipe", None):
            nanny_pid = IPEngine.instance().nanny_pipe.pid
    except Exception:
        pass
    return {
        "rank": rt.rank,
        "size": rt.size,
        "local_rank": rt.local_rank,
        "local_size": rt.local_size,
        "host": rt.host or socket.gethostname(),
        "pid": os.getpid(),
        "device": str(rt.device),
        "backend": rt.backend if dist.is_initialized() else "(none)",
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
        "nanny_pid": nanny_pid,
    }


def state() -> dict:
    """After a failed or interrupted cell: what a release found, whether the group is broken,
    the group's collective count (ranks whose counts differ must rebuild), and whether a DDP
    model exists (it keeps the old group, so the user must wrap it again)."""
    consistency.abandon_pending()  # the failed cell's half-done gradient averaging is void
    rt = runtime.get()
    out = {"release": watcher.take_report(), "broken": bool(rt and rt.broken), "seq": None,
           "ddp": any(isinstance(o, DistributedDataParallel) for o in gc.get_objects())}
    if rt is not None and rt.group is not None and not rt.broken:
        try:
            out["seq"] = rt.group._get_sequence_number_for_group()
        except Exception:
            pass
    return out


def repair() -> None:
    """Rebuild the default process group (collective: every rank calls it at once)."""
    runtime.rebuild_process_group()


def resync() -> int:
    """Copy rank 0's values of tracked tensors that differ (collective); how many differed."""
    return consistency.resync()
