"""The rank's watcher thread: releases the rank from a collective that can never complete, and
reports collectives it has waited in for a while.

When one rank raises, the others may sit in an allreduce waiting for it, inside C++ with the
GIL released, where neither SIGINT nor any Python signal handler reaches them (Python runs
handlers only between bytecodes of the main thread). So each rank keeps a watcher thread that
waits for RELEASE_SIGNAL with ``sigwait`` (the signal is blocked in every other thread, which
inherit the mask from the bootstrap). On the signal it looks at what the main thread is doing:

- in a collective (a torch.distributed call, or ipydist's gradient wait): it breaks this rank's
  communication -- shuts down the sockets of its gloo connections, or aborts the NCCL
  communicator -- so the collective raises at once, here and on the ranks waiting for this one;
- anywhere else in the cell's code: it sends the main thread SIGINT (a KeyboardInterrupt, as
  Ctrl-C would);
- outside a cell (it ended, or has not begun): nothing. A KeyboardInterrupt while ipykernel
  receives, dispatches or replies would lose the cell's reply, and the notebook would wait for
  it forever. So the rank knows when it runs a cell's code (IPython's pre_run_cell and
  post_run_cell events, hooked by :func:`attach`), the watcher sends SIGINT only then, and the
  SIGINT handler it installs for the cell raises only then too: a signal that was on its way
  as the cell ended interrupts nothing. Either way the rank logs it on its own stderr.

Between signals the watcher also looks at the main thread's stack twice a second, to tell the
notebook when this rank has been waiting in one collective for a while
(:mod:`ipydist.rank.stack_sampler`).

A second signal in the same cell does both. Either way the process group is then marked
broken, and the notebook side rebuilds it on every rank (``ipydist.rank.calls.recover``) before
the next cell, so no half-finished collective's bytes cross into it.

This module imports neither torch nor MPI: it is installed before either starts a thread. The
bootstrap hands it the function that breaks communication (:func:`break_communication_with`)
once the process group exists.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

from ipydist.protocol import CELL_KEY, RELEASE_SIGNAL, STATE_KEY, VITALS_KEY
from ipydist.rank import channel, stack_sampler, vitals

#: How long a release waits for a rank in Python code to end its cell by itself (see _settle).
SETTLE_SECONDS = 0.3
#: ... and at most this long while the rank shows the cell's error (it is ending by itself).
ERROR_REPORT_SECONDS = 5.0

_main_ident: int | None = None
#: True while the main thread runs a cell's code (between pre_run_cell and post_run_cell).
_in_cell = False
#: What the last release found, for the notebook's message: {"what", "broke", "time"}.
_last: dict | None = None
_released_this_cell = 0
#: Makes every pending collective of this rank fail now; True if there was a group to break.
#: Set by the bootstrap once the process group exists (None before: nothing to break).
_break_communication: Callable[[], bool] | None = None
#: Whether the cell is stopped at a pdb prompt (set by the debugger: the watcher cannot
#: import it, which imports the watcher).
_at_breakpoint: Callable[[], bool] | None = None


def install() -> None:
    """Start the watcher; call from the main thread before any other thread starts."""
    global _main_ident
    if _main_ident is not None or not hasattr(signal, "pthread_sigmask"):
        return
    _main_ident = threading.get_ident()
    signal.pthread_sigmask(signal.SIG_BLOCK, {RELEASE_SIGNAL})
    threading.Thread(target=_watch, name="ipydist-watcher", daemon=True).start()


def attach(shell) -> None:
    """Follow ``shell``'s cells (call once the engine's shell exists, from the main thread)."""
    if _cell_started not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _cell_started)
        shell.events.register("post_run_cell", _cell_ended)


def _cell_started(*_) -> None:
    global _in_cell
    # ipykernel set SIGINT to the default handler for this request; ours raises only in a cell
    # (ipykernel puts its own back after the reply)
    signal.signal(signal.SIGINT, _interrupt_cell)
    _in_cell = True
    channel.publish(CELL_KEY, "started")


def _cell_ended(*_) -> None:
    global _in_cell
    _in_cell = False
    # before the reply: if the reply is lost, the notebook knows the rank is done all the same
    channel.publish(CELL_KEY, "ended")


def _interrupt_cell(signum, frame) -> None:
    if _in_cell:
        raise KeyboardInterrupt
    log("an interrupt arrived after the cell ended: ignored")


def log(text: str) -> None:
    """To the rank's own stderr (mpiexec's output), never to a cell's output."""
    try:
        print(f"ipydist: rank watcher: {text}", file=sys.__stderr__, flush=True)
    except Exception:
        pass


def breakpoints_with(stopped: Callable[[], bool]) -> None:
    """How the vitals tell a rank stopped at a pdb prompt (set by the debugger)."""
    global _at_breakpoint
    _at_breakpoint = stopped


def break_communication_with(breaker: Callable[[], bool]) -> None:
    """What a release calls to break this rank's pending collectives (set by the bootstrap)."""
    global _break_communication
    _break_communication = breaker


def _watch() -> None:
    collectives = stack_sampler.CollectiveSampler()
    readings = vitals.Vitals()
    timed = hasattr(signal, "sigtimedwait")  # not on macOS: no stall reports there
    next_vitals = 0.0
    while True:
        got: signal.struct_siginfo | int | None
        if timed:
            got = signal.sigtimedwait({RELEASE_SIGNAL}, stack_sampler.SAMPLE_SECONDS)
        else:
            got = signal.sigwait({RELEASE_SIGNAL})
        try:
            now = time.monotonic()
            if got:
                _on_release()
            # between cells no collective runs: the stacks are left unread (an idle rank's
            # CPU), once a call the last sample found is let go (its report taken back)
            elif (_in_cell or collectives.following) and (
                    report := collectives.sample(main_frame(), now)):
                channel.publish(STATE_KEY, report)
            if _in_cell and vitals.enabled and now >= next_vitals:
                next_vitals = now + vitals.VITALS_SECONDS - stack_sampler.SAMPLE_SECONDS / 2
                state = collectives.current(now)
                if _at_breakpoint is not None and _at_breakpoint():
                    state["debugger"] = True
                channel.publish(VITALS_KEY, readings.sample(state))
        except Exception as e:  # never let the watcher die
            log(str(e))


def main_frame():
    """The main thread's current frame (None before :func:`install`)."""
    return sys._current_frames().get(_main_ident) if _main_ident else None


def in_cell() -> bool:
    """Whether the main thread runs a cell's code now."""
    return _in_cell


def _on_release() -> dict | None:
    """Get the main thread out of whatever it waits in (see the module docstring)."""
    global _last, _released_this_cell
    if not _in_cell:  # the cell ended (or has not begun): a release must not touch the rest
        log("a release arrived outside a cell: nothing to release")
        return None
    _released_this_cell += 1
    force = _released_this_cell > 1
    what, ended = _settle(0.0 if force else SETTLE_SECONDS)
    broke = False
    if what is not None or force:
        broke = _break_communication() if _break_communication is not None else False
    if not ended and (what is None or force):
        # a real SIGINT aimed at the main thread: it also cuts short a blocking call such as
        # time.sleep (interrupt_main() would wait for that call to return); the handler checks
        # once more that the cell is still running. The second release sends it even to a rank
        # in a collective: whatever the collective does next, the rank then leaves the cell.
        assert _main_ident is not None  # install set it before it started the watcher
        signal.pthread_kill(_main_ident, signal.SIGINT)
    _last = {"what": what, "broke": broke, "ended": ended, "time": time.time()}

    return _last


def _settle(seconds: float) -> tuple[str | None, bool]:
    """(the collective the main thread is in, whether its cell ended by itself), looking for
    up to ``seconds`` while it is in neither.

    When a peer's release broke a collective, this rank's collective fails at once, often
    before this rank's own signal is handled: its main thread is then in Python code, on its
    way out of the cell with the collective's error. A SIGINT now would only replace that
    error with a KeyboardInterrupt, so wait a moment for the cell to end or for the main thread
    to enter a collective (which is then broken).
    """
    start = time.monotonic()
    deadline = start + seconds
    while True:
        frame = main_frame()
        found = stack_sampler.collective_frame(frame)
        what = found[1] if found else None
        if what is not None:
            return what, False
        if not _in_cell:
            return None, True
        now = time.monotonic()
        if _showing_an_error(frame):
            # the cell is ending with its error (even when a second release insists): the
            # first traceback a rank formats can take over a second on a busy machine
            deadline = min(max(deadline, now + SETTLE_SECONDS), start + ERROR_REPORT_SECONDS)
        if now >= deadline:
            return None, False
        time.sleep(0.01)


#: IPython's and ipykernel's functions that format or send a cell's exception (IPython 9
#: formats it twice: for display, and for the history).
_SHOWING_ERROR = {"showtraceback", "_showtraceback", "structured_traceback",
                  "_format_exception_for_storage"}


def _showing_an_error(frame) -> bool:
    """Whether the main thread is formatting or sending the cell's exception."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _SHOWING_ERROR and (
                "IPython" in code.co_filename or "ipykernel" in code.co_filename):
            return True
        frame = frame.f_back
    return False


def released_in_this_cell() -> bool:
    """Whether a release reached this rank in the cell now running (or that just ended)."""
    return _released_this_cell > 0


def take_report() -> dict | None:
    """What the last release found (None if there was none), once: the next cell starts over."""
    global _last, _released_this_cell
    report, _last, _released_this_cell = _last, None, 0
    return report
