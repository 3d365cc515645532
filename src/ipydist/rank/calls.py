"""The functions the notebook runs on every rank, by name, through
:func:`ipydist.protocol.on_rank` (so the kernel never imports this module, nor torch).

Each is a small question or repair: what the rank is, and after a failed or interrupted cell
what a release found and bringing the ranks back in step (collectively, with a deadline).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from IPython import get_ipython

from ipydist import protocol
from ipydist.rank import (
    cell_numbers,
    consensus,
    frameworks,
    released_errors,
    watcher,
)
from ipydist.rank.healing import process_state
from ipydist.rank.introspection import control, debugger
from ipydist.rank.start import forkserver
from ipydist.torch._core import events, process_group, resync, topology, waiting
from ipydist.torch._wire import handles
from ipydist.torch.horovod import process_sets


def attach() -> protocol.RankInfo:
    """Right after the ranks register: follow the engine's cells (see ``watcher.attach``),
    number them as the notebook does, tell frameworks imported later what the ranks are, and
    say what this rank is, for the table the notebook shows."""
    watcher.attach(get_ipython())
    process_state.remember_start()
    cell_numbers.attach(get_ipython())
    released_errors.attach(get_ipython())
    released_errors.warm_up()
    control.install(get_ipython().kernel)
    debugger.install(get_ipython())
    _not_a_prompt()
    rt = topology.get()
    assert rt is not None  # the rank's bootstrap made it before the engine started
    frameworks.install(rt.local_size)
    return info()


def _not_a_prompt() -> None:
    """Take away the prompts IPython's kernel shell sets "so that scripts can decide if they are
    running interactively" (``sys.ps1``): a rank is a process mpiexec started, not a session at
    a prompt, and libraries read them to refuse launching from one. Lightning's
    ``Trainer(strategy="ddp")`` refuses an interactive process (it would spawn the others
    itself); on a rank the processes exist already, and it uses them (its MPI environment)."""
    for name in ("ps1", "ps2", "ps3"):
        if hasattr(sys, name):
            delattr(sys, name)


def debug(command: str | None) -> dict[str, Any]:
    """``%dist_debug``: one step of post-mortem debugging of this rank's last error."""
    return debugger.post_mortem(command)


def error_frames() -> str:
    """Where nobody can type at a pdb prompt: this rank's last error's frames and locals."""
    return debugger.frames_with_locals()


def info() -> protocol.RankInfo:
    """What the notebook shows about this rank."""
    rt = topology.get()
    assert rt is not None  # the rank's bootstrap made it before the engine started
    nanny_pid = None
    try:
        from ipyparallel.engine.app import IPEngine

        if IPEngine.initialized() and getattr(IPEngine.instance(), "nanny_pipe", None):
            nanny_pid = IPEngine.instance().nanny_pipe.pid
    except Exception:
        pass
    return protocol.RankInfo(
        rank=rt.rank, size=rt.size, host=rt.host or socket.gethostname(), pid=os.getpid(),
        device=str(rt.device), backend=rt.backend if dist.is_initialized() else "(none)",
        transport="hierarchical" if rt.node_data is not None else rt.transport,
        gpu_sharing=rt.gpu_sharing,
        local_rank=rt.local_rank, local_size=rt.local_size,
        cross_rank=rt.cross_rank, cross_size=rt.cross_size,
        launched_pid=forkserver.stub_pid or os.getpid(),
        threads=int(os.environ.get("OMP_NUM_THREADS", "0")), nanny_pid=nanny_pid,
    )


#: Recovery's deadlines, in seconds from when a rank takes the request (see protocol).
ARRIVE_SECONDS = protocol.RECOVERY_ARRIVE_SECONDS
REBUILD_SECONDS = protocol.RECOVERY_REBUILD_SECONDS
RESYNC_SECONDS = protocol.RECOVERY_RESYNC_SECONDS


def recover(number: int, resync_tensors: bool) -> protocol.RecoveryReport:
    """After a failed or interrupted cell, on every rank at once: report what the release
    found, and bring the ranks back in step -- together or not at all.

    The ranks first agree (over MPI, which a release never breaks: ``consensus.decide``)
    whether the process group must be rebuilt: a release broke it, or the ranks no longer
    agree on how many collectives it ran. Then they rebuild it, agree that every rank
    succeeded, and, when ``resync_tensors`` (ranks were released mid-cell), put drifted parameters
    back in step. Each step has a deadline; a rank that misses one, or hears that another
    did, drops the group and says why (the notebook tells the user to restart), so nothing
    the recovery started lives on and no rank waits for the others past RECOVERY_SECONDS.
    ``number`` is this recovery's number (the notebook counts them), which tags its messages.
    """
    start = time.monotonic()
    resync.abandon_pending()  # the failed cell's half-done gradient averaging is void
    handles.abandon_all()  # and so is every async operation it left in flight
    rt = topology.get()
    out = protocol.RecoveryReport(release=watcher.take_report())
    if rt is None or rt.control_comm is None:
        return out  # not started by mpiexec: a world of one, nothing to agree on
    comm = rt.control_comm
    broken = bool(rt.broken)
    seq = process_group.collective_count(rt)
    votes = consensus.decide(comm, number, 0, [int(broken), seq, int(rt.checks_unfinished)],
                            start + ARRIVE_SECONDS)
    if votes is None:
        return _give_up(out, "not every rank joined the recovery in time")
    if any(pending for _, _, pending in votes):  # a collective check was left unfinished
        if not waiting.replace_check_comm(start + REBUILD_SECONDS):
            return _give_up(out, "replacing the communicator of collective checks timed out")
    if any(b for b, _, _ in votes) or len({s for _, s, _ in votes}) > 1:
        failed = _together(comm, number, 2, start + REBUILD_SECONDS,
                           "rebuilding the process group", lambda: process_group.rebuild(
                               timeout_s=max(REBUILD_SECONDS - (time.monotonic() - start), 1.0)))
        if failed:
            return _give_up(out, failed)
        from ipydist.rank.healing import state_copy

        followed, marked = state_copy.follow_new_group()
        out = replace(out, rebuilt=True, followed=tuple(followed), marked=tuple(marked))
    if process_sets.any_added():  # an abandoned operation may have left theirs unusable
        failed = _together(comm, number, 4, start + REBUILD_SECONDS,
                           "making the process sets' communicators again",
                           process_sets.reconnect_all)
        if failed:
            return _give_up(out, failed)
    if resync_tensors:
        fixed = []
        failed = _together(comm, number, 3, start + RESYNC_SECONDS,
                           "checking that the models are identical",
                           lambda: fixed.append(resync.from_root(
                               timeout_s=RESYNC_SECONDS - (time.monotonic() - start))))
        if failed:
            return _give_up(out, failed)
        out = replace(out, fixed=fixed[0])
    return out


def _together(comm, number: int, step: int, deadline: float, what: str, action) -> str | None:
    """Do ``action`` on this rank, then agree that it succeeded on every rank by
    ``deadline``; None if it did, else why not (the same on every rank that heard)."""
    failure = None
    try:
        action()
    except Exception as e:
        failure = f"{what} failed on rank {comm.Get_rank()}: {e}"
    votes = consensus.decide(comm, number, step, [int(failure is None)], deadline)
    if votes is not None and all(ok for (ok,) in votes):
        return None
    return failure or f"{what} failed on {_who(votes, 'another rank')}"


def _who(votes, fallback: str) -> str:
    if votes is None:
        return fallback
    bad = [str(r) for r, (ok,) in enumerate(votes) if not ok]
    return f"rank{'s' if len(bad) > 1 else ''} {', '.join(bad)}" if bad else fallback


def _give_up(out: protocol.RecoveryReport, why: str) -> protocol.RecoveryReport:
    """Leave the process group dropped (collectives then raise, saying to restart)."""
    watcher.log(f"recovery gave up: {why}")
    process_group.abandon()
    return replace(out, failed=why)


def heal(dead: list[int], replace: bool, hosts: list[str] | None = None,
         env: Sequence[str] = (), spawn: bool = True) -> protocol.HealReport:
    """``--elastic``, after ``dead`` died: the world again (see
    :mod:`ipydist.rank.healing.heal`)."""
    from ipydist.rank.healing import heal as healing

    return healing.heal(dead, replace, hosts, env, spawn)


def leave(gone: list[int]) -> protocol.HealReport:
    """After a heal whose replacements ``gone`` could not be given rank 0's state: they leave,
    the others go on renumbered (see :func:`ipydist.rank.healing.heal.leave`)."""
    from ipydist.rank.healing import heal as healing

    return healing.leave(gone)


def spares() -> tuple[int, ...]:
    """The pids of the hot spares waiting (``--spares``), for the start table."""
    from ipydist.rank.healing import spares as hot_spares

    return hot_spares.spare_pids


def elastic_reset(restore: bool) -> int:
    """After a heal (``restore``) or a resize: Horovod's elastic states synced, callbacks run."""
    from ipydist.torch.horovod import elastic

    return elastic.after_heal(restore)


def resize(size: int, env: Sequence[str] = (), spawn: bool = True) -> protocol.HealReport:
    """``Session.scale``: a world of ``size`` ranks (see
    :func:`ipydist.rank.healing.heal.resize`)."""
    from ipydist.rank.healing import heal as healing

    return healing.resize(size, env, spawn)


def copy_state(root: int, to: list[int], was_size: int | None = None) -> protocol.HealReport:
    """After a heal or a resize: ``root``'s variables and random states to the new ranks
    ``to`` (``was_size``: the world's size before a resize)."""
    from ipydist.rank.healing import state_copy

    return state_copy.copy_from(root, to, was_size)


def resized(was_size: int) -> protocol.HealReport:
    """After a resize, on a rank that stayed (its number kept): its samplers, optimizers and
    process sets follow the new size."""
    from ipydist.rank.healing import state_copy

    return state_copy.resized(was_size)


def timeline(action: str) -> list[dict[str, Any]] | None:
    """``%dist_timeline``: start recording ("start"), or return this rank's events so far
    ("events"), or return them and stop ("stop")."""
    if action == "start":
        events.start(events.path or protocol.TIMELINE_FILE)
        return None
    if action == "stop":
        return events.stop()
    return events.recorded()
