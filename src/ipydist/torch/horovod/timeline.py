"""Horovod's timeline: what each collective spent its time on, as a Chrome trace.

``hvd.start_timeline(path)`` (or ``HOROVOD_TIMELINE=path`` in the ranks' environment, e.g.
``%dist_start --env HOROVOD_TIMELINE=trace.json``) starts recording on every rank;
``hvd.stop_timeline()`` (collective) gathers every rank's events and rank 0 writes them, one
process row per rank, to ``path``, loadable in ``chrome://tracing`` or https://ui.perfetto.dev.
``%dist_timeline`` shows the same under a notebook cell.

Each collective gives two events, named in the file as Horovod names its phases, for the tools
that read Horovod's timelines: ``NEGOTIATE_<OP>``, the call check that every rank makes the
same call (:mod:`ipydist.torch._wire.call_check`; Horovod's coordinator negotiates the same
way), and ``<OP>``, from the moment its data was posted until it was seen done, with its dtype,
shape and wire. ``%dist_timeline`` shows them in ipydist's words: ``allreduce call check`` and
``allreduce``. DistributedOptimizer's buckets are
``ALLREDUCE`` events named after their first parameter. Times are wall-clock (one host's ranks
share it; other hosts' are as close as their clocks). The events are recorded by
:mod:`ipydist.torch._core.events`.
"""

from __future__ import annotations

import os

from ipydist.protocol import chrome_trace, write_json
from ipydist.torch._core import events, process_group
from ipydist.torch.horovod.functions import allgather_object


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this rank's collectives, for ``stop_timeline()`` to write to
    ``file_path`` (Horovod's arguments; ``mark_cycles`` is accepted and has no effect:
    ipydist has no background cycles to mark)."""
    if not file_path:
        raise ValueError("start_timeline needs the path of the file to write")
    events.start(os.fspath(file_path))


def stop_timeline() -> str | None:
    """Stop recording and write every rank's events to the path given at start (collective:
    rank 0 writes one file). Returns the path on rank 0, None elsewhere."""
    every = allgather_object(events.stop())
    rt = process_group.ensure()
    if rt.rank != 0 or events.path is None:
        return None
    write_json(events.path, chrome_trace(every))
    return events.path
