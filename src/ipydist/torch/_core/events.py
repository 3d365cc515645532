"""The events the timeline shows (:mod:`ipydist.torch.horovod.timeline`), recorded where collectives
run: the call check, the data, DistributedOptimizer's buckets. Nothing here imports the
collectives, so that they can all record here.

Recording costs one check of a module flag per collective when off, and a list append when
on; at most MAX_EVENTS are kept per rank (the oldest go first).
"""

from __future__ import annotations

import time

from ipydist.protocol import TIMELINE_CHECK_LANE as CHECK_LANE
from ipydist.protocol import TIMELINE_CHECK_PREFIX
from ipydist.protocol import TIMELINE_DATA_LANE as DATA_LANE

#: Events kept per rank: the oldest go first beyond this.
MAX_EVENTS = 200_000
#: Whether events are being recorded (read on every collective: a plain module flag).
recording = False
#: Where ``hvd.stop_timeline()`` writes them (given at start).
path: str | None = None
_events: list[dict] = []


def record(name: str, started: float, ended: float, lane: int = DATA_LANE, **args) -> None:
    """One event that ran from ``started`` to ``ended`` (``time.perf_counter()`` values),
    stamped in wall-clock microseconds so that ranks' events line up."""
    now_wall, now = time.time(), time.perf_counter()
    if len(_events) >= MAX_EVENTS:
        del _events[: MAX_EVENTS // 10]
    _events.append({"name": name, "ph": "X", "ts": (now_wall - (now - started)) * 1e6,
                    "dur": max(ended - started, 0.0) * 1e6, "tid": lane,
                    "args": {k: v for k, v in args.items() if v is not None}})


def checked(kind: str, started: float, ended: float, set_size: int | None = None) -> None:
    """The call check of a call of ``kind`` (its names: "allreduce", "optimizer step"), named
    in the trace as Horovod names the phase: ``NEGOTIATE_ALLREDUCE``."""
    record(TIMELINE_CHECK_PREFIX + kind.upper().replace(" ", "_"), started, ended, CHECK_LANE,
           process_set_size=set_size)


def start(file_path: str) -> None:
    global recording, path
    path = file_path
    _events.clear()
    recording = True


def start_from_environment(environ) -> None:
    """``HOROVOD_TIMELINE=path``: record from ``hvd.init()`` on, as Horovod does."""
    wanted = environ.get("HOROVOD_TIMELINE", "")
    if wanted and path is None:
        start(wanted)


def stop() -> list[dict]:
    """Stop recording; this rank's events, which are forgotten here."""
    global recording
    recording = False
    taken = list(_events)
    _events.clear()
    return taken


def recorded() -> list[dict]:
    """This rank's events so far."""
    return list(_events)
