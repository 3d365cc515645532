"""Releasing a rank from a collective that can never complete: the rank side.

When one rank raises, the others may sit in an allreduce waiting for it, inside C++ with the
GIL released, where neither SIGINT nor any Python signal handler reaches them (Python runs
handlers only between bytecodes of the main thread). So each rank keeps a watcher thread that
waits for RELEASE_SIGNAL with ``sigwait`` (the signal is blocked in every other thread, which
inherit the mask from the bootstrap). On the signal it looks at what the main thread is doing:

- in a collective (a torch.distributed call, or ipydist's gradient wait): it breaks this rank's
  communication -- shuts down the sockets of its gloo connections, or aborts the NCCL
  communicator -- so the collective raises at once, here and on the ranks waiting for this one;
- anywhere else: it sends the main thread SIGINT (a KeyboardInterrupt, as Ctrl-C would).

Between signals the watcher also looks at the main thread's stack once a second, to tell the
notebook when this rank has been waiting in one collective for a while (:mod:`ipydist.stall`).

A second signal in the same cell does both. Either way the process group is then marked
broken, and the notebook side rebuilds it on every rank (:func:`repair`) before the next cell,
so no half-finished collective's bytes cross into it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from ipydist import stall

RELEASE_SIGNAL = signal.SIGUSR1
#: How long a release waits for a rank in Python code to end its cell by itself (see _settle).
SETTLE_SECONDS = 0.3

_main_ident: int | None = None
#: What the last release found, for the notebook's message: {"what", "broke", "time"}.
_last: dict | None = None
_released_this_cell = 0


def install() -> None:
    """Start the watcher; call from the main thread before any other thread starts."""
    global _main_ident
    if _main_ident is not None or not hasattr(signal, "pthread_sigmask"):
        return
    _main_ident = threading.get_ident()
    signal.pthread_sigmask(signal.SIG_BLOCK, {RELEASE_SIGNAL})
    threading.Thread(target=_watch, name="ipydist-release", daemon=True).start()


def _watch() -> None:
    sampler = stall.CollectiveSampler()
    timed = hasattr(signal, "sigtimedwait")  # not on macOS: no stall reports there
    while True:
        if timed:
            got = signal.sigtimedwait({RELEASE_SIGNAL}, stall.SAMPLE_SECONDS)
        else:
            got = signal.sigwait({RELEASE_SIGNAL})
        try:
            if got:
                release()
            elif report := sampler.sample(_main_frame(), time.monotonic()):
                from ipydist.engine import publish

                publish(stall.STATE_KEY, report)
        except Exception as e:  # never let the watcher die
            print(f"ipydist: rank watcher: {e}", file=sys.stderr, flush=True)


def _main_frame():
    return sys._current_frames().get(_main_ident) if _main_ident else None


def release() -> dict:
    """Get the main thread out of whatever it waits in (see the module docstring)."""
    global _last, _released_this_cell
    _released_this_cell += 1
    force = _released_this_cell > 1
    what, ended = _settle(0.0 if force else SETTLE_SECONDS)
    broke = False
    if what is not None or force:
        broke = break_communication()
    if what is None and not ended:
        # a real SIGINT aimed at the main thread: it also cuts short a blocking call such as
        # time.sleep (interrupt_main() would wait for that call to return)
        signal.pthread_kill(_main_ident, signal.SIGINT)
    _last = {"what": what, "broke": broke, "ended": ended, "time": time.time()}
    return _last


def _settle(seconds: float) -> tuple[str | None, bool]:
    """(the collective the main thread is in, whether its cell ended by itself), looking for
    up to ``seconds`` while it is in neither.

    When a peer's release broke a collective, this rank's collective fails at once, often
    before this rank's own signal is handled: its main thread is then in Python code, on its
    way out of the cell with the collective's error. A SIGINT now would only replace that
    error with a KeyboardInterrupt, so wait a moment for the cell to end (IPython counts a
    finished cell) or for the main thread to enter a collective (which is then broken).
    """
    shell = _shell()
    count = getattr(shell, "execution_count", None)
    deadline = time.monotonic() + seconds
    while True:
        what = collective_in(_main_frame())
        if what is not None:
            return what, False
        if count is not None and shell.execution_count != count:
            return None, True
        if time.monotonic() >= deadline:
            return None, False
        time.sleep(0.01)


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def collective_in(frame) -> str | None:
    """The collective the stack is in, e.g. ``"all_reduce"``, or None."""
    found = stall.collective_frame(frame)
    return found[1] if found else None


def break_communication() -> bool:
    """Make every pending collective of this rank fail now; True if there was a group."""
    from ipydist.torch import runtime

    rt = runtime.get()
    if rt is None or rt.group is None:
        return False
    rt.broken = True
    if rt.backend == "nccl":
        try:
            import torch

            rt.group._get_backend(torch.device("cuda")).abort()
        except Exception as e:
            print(f"ipydist: could not abort the NCCL communicator: {e}", file=sys.stderr)
        return True
    for fd in rt.comm_fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed
    return True


def state() -> dict:
    """For the notebook after a failed cell: what a release found, whether the group is
    broken, and the group's collective count (ranks that differ must rebuild)."""
    global _last, _released_this_cell
    from ipydist.torch import runtime

    rt = runtime.get()
    out = {"release": _last, "broken": bool(rt and rt.broken), "seq": None}
    _last, _released_this_cell = None, 0
    if rt is not None and rt.group is not None and not rt.broken:
        try:
            out["seq"] = rt.group._get_sequence_number_for_group()
        except Exception:
            pass
    return out


def repair() -> None:
    """Rebuild the default process group (collective: every rank calls it at once)."""
    import torch.distributed as dist

    from ipydist.torch import runtime

    rt = runtime.get()
    if rt is None:
        return
    if dist.is_initialized():
        runtime._retire(dist.group.WORLD)  # kept referenced: see runtime._retired_groups
        dist.destroy_process_group()
    runtime.init_process_group(rt)
