"""One ``%%everyrank`` cell in flight: waiting for the ranks while showing what they send.

The wait loop runs in the notebook's main thread and wakes every 50 ms: it shows the ranks'
output, printed and rich (merged by :class:`LineMerger`, tagged as
:mod:`~ipydist.notebook.output.rich` says), feeds their metrics to the history and the live view,
warns of a stall (some ranks waiting in a collective the others never entered: see
:mod:`ipydist.notebook.failures.stall`), and enforces ``--timeout``. Ctrl-C (the stop button)
lands here too, and interrupts the ranks.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipydist.errors import (
    CellInterrupted,
    CellTimeout,
    ClusterError,
    RankDied,
    RankError,
    ReplyLost,
    wrap_message,
)
from ipydist.notebook import ipp
from ipydist.notebook.failures import recovery
from ipydist.notebook.failures.stall import StallWatch
from ipydist.notebook.introspection import debugging
from ipydist.notebook.live.view import LiveView
from ipydist.notebook.output import display, rich
from ipydist.notebook.output.iopub import IOPubCollector
from ipydist.notebook.output.lines import FirstLines, LineMerger, Redraw, hold_for_load
from ipydist.notebook.stop_button import StopButton
from ipydist.protocol import CELL_NUMBER_KEY, DEBUG_RANKS_KEY
from ipydist.specs import describe_ranks

if TYPE_CHECKING:
    from ipydist.session_face import SessionFace

#: How often the wait loop wakes to show output and metrics.
POLL_SECONDS = 0.05
#: How often the wait loop checks that every rank's process is still there.
ALIVE_CHECK_SECONDS = 0.5
FIRST_ALIVE_CHECK_SECONDS = 0.1
#: After the ranks replied, how long to wait for more of their output when none is coming.
OUTPUT_STALL_SECONDS = 2.0
#: A rank that said it ended the cell but whose reply has not come after this long lost it.
REPLY_LOST_SECONDS = 5.0


@dataclass
class RunResult:
    """What a cell produced, beyond the output already shown."""

    ranks: list[int]
    execute_results: dict[int, dict] = field(default_factory=dict)
    elapsed: float = 0.0
    #: What the first rank's cell put in its pager (``obj?``), as mime bundles.
    pages: list[dict] = field(default_factory=list)


class CellRun:
    """One cell on ``targets``, sent as it starts, until every rank has replied."""

    def __init__(self, session: SessionFace, code: str, targets: list[int], output: str,
                 timeout: float | None, started: float, debug_ranks: list[int] | None = None):
        self.session = session
        assert session.cluster is not None  # Session.run hands over a running cluster
        self.cluster = session.cluster
        self.targets = targets
        self.started = started
        self.deadline = None if not timeout else started + float(timeout)
        self.timeout = timeout
        self.collector = IOPubCollector(targets, direct={"vitals": session.monitor.accept})
        number = _cell_number(session)
        # where breakpoint() stops: on debug_ranks (all by default), if a person can type
        stopping = (targets if debug_ranks is None else debug_ranks) if (
            debugging.can_prompt()) else None
        self.ar = ipp.execute(self.cluster.view(targets), code, self.collector.watch,
                              {DEBUG_RANKS_KEY: stopping,
                               CELL_NUMBER_KEY: number})
        session.monitor.cell_started(number, targets)
        self.breakpoints = debugging.Breakpoints(
            self.cluster, lambda: self._emit(self.merger.ready(now=float("inf"))))
        self.shown = targets if output == "all" else targets[:1]
        self.merger = LineMerger(self.shown, hold_for_load(os.getloadavg()[0],
                                                           os.cpu_count() or 1))
        self.displays = rich.DisplayBook(self.shown)
        self.bars = display.Bars()
        self.first_lines = FirstLines()
        self.live = LiveView(session.metrics, session.size, cell=number)
        self.result = RunResult(targets)
        self.stalls = StallWatch(targets, session.options.stall_warning, session.words.timeout)
        #: A failing rank's peers get this long to finish by themselves before release.
        self.failure_grace = float(timeout) if timeout else session.options.failure_grace
        self.first_failure: tuple[int, float] | None = None  # (rank, when)
        self.release = recovery.Release(self.cluster, self.ar, targets)
        #: rank -> when it said it ended the cell's code (its reply should follow at once)
        self.ended: dict[int, float] = {}
        #: Ranks whose reply was lost on the way (they ended the cell, and are idle).
        self.lost: list[int] = []
        #: Ranks released that did not stop in time (they still run the cell).
        self.unstopped: list[int] = []
        #: Ranks found dead (``--elastic``: the others are released, and live on).
        self.dead: list[int] = []

    def wait(self) -> RunResult:
        """Block until every rank finished the cell; raise RankError if any raised."""
        try:
            with StopButton() as stop_button:
                self._wait_for_ranks(stop_button)
        except KeyboardInterrupt:
            running = self._stop()
            notes = self._recover(running)
            raise CellInterrupted(
                " ".join([f"Interrupted {describe_ranks(running)}.", *notes])) from None
        finally:
            self.collector.finish()
            self._show()
            self._emit(self.merger.flush())
            if note := self.displays.note():
                print(note, file=sys.stderr, flush=True)
            self.live.finish()
            self.session.monitor.cell_ended()
        self.result.elapsed = time.perf_counter() - self.started
        replies = ipp.replies(self.ar, self.targets)
        failures = {rank: _as_failure(reply) for rank, reply in replies.items()
                    if isinstance(reply, Exception)}
        if any(failure.ename == "EngineError" for failure in failures.values()):
            # ipyparallel failed the cell of a rank whose engine it saw die (on another host,
            # where that is the first news of it): say which rank died and how, as for a death
            # seen while waiting, rather than report its task's error
            if death := self.session.death_report():
                raise RankDied(death)
        if failures or self.unstopped:
            notes = self._recover(self.released)
            # the rank that failed while others still ran goes first; otherwise rank order
            first = self.first_failure[0] if self.first_failure and self.released else None
            if not failures:  # only ranks that would not stop: say so
                raise ClusterError(" ".join(notes))
            raise RankError(failures, first=first, released=self.released, notes=notes)
        if self.lost:
            raise ReplyLost(self._lost_note())
        self.result.pages = ipp.pages(replies.get(self.targets[0]))
        return self.result

    def _wait_for_ranks(self, stop_button: StopButton) -> None:
        """Until every rank finished the cell (or can no longer), showing what they send and
        watching for failures, deaths, stalls and ``--timeout``; the stop button is looked at
        once a round."""
        # a rank that died: first checked soon (a cell sent to a dead cluster), then every
        # ALIVE_CHECK_SECONDS; a cell that ends sooner costs nothing
        next_alive_check = time.monotonic() + FIRST_ALIVE_CHECK_SECONDS
        while not self._all_done():
            stop_button.check()
            self._show()
            if self.breakpoints.waiting:
                with stop_button.as_before():
                    self._paused(self.breakpoints.serve())
            self._contain_failure()
            self._warn_of_stall()
            if time.monotonic() >= next_alive_check:
                self._check_alive()
                next_alive_check = time.monotonic() + ALIVE_CHECK_SECONDS
            if self.deadline is not None and time.perf_counter() > self.deadline:
                running = self._stop()
                if self.first_failure is not None and not self.unstopped:
                    # a rank raised before the deadline: its error is the story, and the
                    # others were released as after the failure grace
                    break
                notes = self._recover(running)
                raise CellTimeout(" ".join([
                    f"the cell ran past --timeout {self.timeout:g} s; interrupted "
                    f"{describe_ranks(running)}.", *notes]))
        if not self.unstopped:
            self._wait_for_output(stop_button)

    @property
    def released(self) -> list[int]:
        """Ranks released in this cell: after a failure their errors are a consequence."""
        return self.release.ranks

    def _all_done(self) -> bool:
        """Whether every rank replied, or can no longer: it lost its reply, or was released and
        did not stop in time."""
        if ipp.wait(self.ar, POLL_SECONDS):
            return True
        now = time.monotonic()
        running = [r for r in ipp.still_running(self.ar, self.targets) if r not in self.dead]
        self.lost = [r for r in running
                     if r in self.ended and now - self.ended[r] > REPLY_LOST_SECONDS]
        if self.release.given_up(now):
            self.unstopped = [r for r in running if r not in self.lost]
        else:
            self.unstopped = []
        if set(running) > set(self.lost) | set(self.unstopped):
            return False
        for rank in self.lost:  # so the rank no longer counts as busy with it
            ipp.forget(self.cluster.client, ipp.msg_id(self.ar, self.targets, rank))
        return True

    def _check_alive(self) -> None:
        if death := self.session.death_report():
            if self.session.elastic:  # the others live on: release those still in the cell
                self.dead = [info.rank for info in self.cluster.dead_ranks()
                             if info.rank in self.targets]
                for rank in self.dead:
                    ipp.forget(self.cluster.client, ipp.msg_id(self.ar, self.targets, rank))
                self._stop()
            raise RankDied(death)
        if not self.cluster.controller_alive():
            raise ClusterError(
                f"the ipyparallel controller (pid {self.cluster.controller_pid}) is gone, so "
                f"the ranks can no longer be reached. Run {self.session.words.restart} to "
                "start a fresh cluster.")

    def _stop(self) -> list[int]:
        """Stop the ranks still running the cell (Ctrl-C, ``--timeout``): release them, again a
        second later for those still running, and wait up to STOP_WAIT_SECONDS for them
        (showing their output, and releasing a rank that begins the cell only now). Returns
        the ranks that were running."""
        running = [r for r in ipp.still_running(self.ar, self.targets) if r not in self.dead]
        if running:
            self._release(running, time.monotonic())
        while not self._all_done():
            self._show()
            now = time.monotonic()
            still = [r for r in ipp.still_running(self.ar, self.targets)
                     if r not in self.lost and r not in self.dead]
            if still and self.release.due(now):
                self._release(still, now)
        return running

    def _release(self, ranks: list[int], now: float) -> None:
        for rank in ranks:  # a rank that began the cell a moment ago: its event may be queued
            if rank not in self.release.began and self.collector.cell_state(rank):
                self.release.rank_began(rank)
        self.release.send(ranks, now)

    def _recover(self, released: list[int]) -> list[str]:
        notes = []
        if self.lost:
            notes.append(self._lost_note())
        if self.unstopped:
            # the ranks cannot recover together while some still run the cell: the next cell
            # has them recover first, once every rank is idle
            self.cluster.recovery_owed = sorted(set(released) | set(self.unstopped))
            one = len(self.unstopped) == 1
            return [*notes, (
                f"{describe_ranks(self.unstopped)} did not stop within "
                f"{recovery.STOP_WAIT_SECONDS:g} s of being released (code that ignores "
                f"interrupts?) and {'runs' if one else 'run'} the cell on; the next cell "
                f"recovers the ranks once {'it ends' if one else 'they end'}. If "
                f"{'it never does' if one else 'they never do'}, run "
                f"{self.session.words.restart}.")]
        return notes + recovery.recover(self.cluster, released, self.session.words.restart)

    def _lost_note(self) -> str:
        one = len(self.lost) == 1
        return (f"{describe_ranks(self.lost)} finished the cell, but {'its' if one else 'their'} "
                "reply never reached the notebook (lost on the way); what it printed is "
                f"above. The rank{'' if one else 's'} and the cluster are fine: run the cell "
                "again if you need its result.")

    def _contain_failure(self) -> None:
        """Once a rank has failed, release the ranks still running: at once when every one of
        them waits in a collective (which can no longer complete), otherwise after
        ``failure_grace`` seconds, so that peers still computing can finish by themselves. A
        second release a second later breaks their communication outright."""
        now = time.monotonic()
        if self.first_failure is None:
            failed = [r for r, what in ipp.outcomes(self.ar, self.targets).items()
                      if what == "failed"]
            if not failed:
                return
            self.first_failure = (failed[0], now)
        running = [r for r in ipp.still_running(self.ar, self.targets) if r not in self.lost]
        if not running or not self.release.due(now):
            return
        blocked = all(rank in self.stalls.waiting for rank in running)
        if blocked or now >= self.first_failure[1] + self.failure_grace:
            self._release(running, now)

    def _paused(self, seconds: float) -> None:
        """A person typed at a pdb prompt for ``seconds``: the cell's clocks stop meanwhile
        (its --timeout, the failure grace, how long ranks have waited in a collective)."""
        if self.deadline is not None:
            self.deadline += seconds
        if self.first_failure is not None:
            self.first_failure = (self.first_failure[0], self.first_failure[1] + seconds)
        self.stalls.waiting = {rank: (name, since + seconds)
                               for rank, (name, since) in self.stalls.waiting.items()}

    def _warn_of_stall(self) -> None:
        if not self.stalls.waiting:
            return
        doing = ipp.outcomes(self.ar, self.targets)
        if warning := self.stalls.check(time.monotonic(), doing):
            self._emit(self.merger.ready(now=float("inf")))  # what came before goes first
            where = debugging.collapse(debugging.stacks(self.cluster, self.targets))
            print("\n".join([*wrap_message(warning), f"Where each rank is now "
                             f"({self.session.words.stack}):", where]), file=sys.stderr,
                  flush=True)

    def _wait_for_output(self, stop_button: StopButton) -> None:
        """The ranks replied; their output may still be on its way (a backlog of a million
        metric points takes seconds to unpack). Keep showing it until it is complete, or until
        none has arrived for OUTPUT_STALL_SECONDS, so a rank that died mid-output cannot hang
        the cell."""
        last_arrival = time.monotonic()
        while not ipp.wait(self.ar, POLL_SECONDS, output=True):
            stop_button.check()
            if self._show():
                last_arrival = time.monotonic()
            elif time.monotonic() - last_arrival > OUTPUT_STALL_SECONDS:
                return

    def _show(self) -> int:
        """Show what arrived; return how many messages that was."""
        events = self.collector.drain()
        for ev in events:
            if ev.kind in ("stdout", "stderr"):
                if ev.rank in self.shown:
                    self.merger.feed(ev.rank, ev.kind, ev.content)
            elif ev.kind == "execute_result":
                self.result.execute_results[ev.rank] = ev.content
            elif ev.kind == "state":
                self.stalls.accept(ev.rank, ev.content, time.monotonic())
            elif ev.kind == "cell":
                self.release.rank_began(ev.rank)
                if ev.content == "ended":
                    self.ended.setdefault(ev.rank, time.monotonic())
            elif ev.kind == "metrics":
                self.session.metrics.accept(ev.rank, ev.content)
            elif ev.kind == "debug":
                self.breakpoints.accept(ev.rank, ev.content)
            elif ev.kind == "display_data" and ev.rank in self.shown:
                if item := self.displays.take(ev.rank, ev.content):
                    self.merger.put(ev.rank, item)  # after what the rank printed before it
        self.live.update()  # the chart first: it opens above the lines that came with it
        self._emit(self.merger.ready(), hold=True)
        return len(events)

    def _emit(self, released, hold: bool = False) -> None:
        """Show what the merger released: printed lines with their tags, and displays (see
        :mod:`ipydist.notebook.output.rich`: each bundle once, tagged unless it is the first
        rank's). The cell's first output may wait for its chart (``hold``: FirstLines)."""
        charted = self.live.widget is not None or not self.live.widgets
        for tag, stream, item in self.first_lines.take(list(released), charted,
                                                       time.monotonic(), hold):
            if isinstance(item, Redraw) and self.bars.show(tag, stream, item):
                continue
            if isinstance(item, str):
                print(f"[{tag}] {item}", end="",
                      file=sys.stderr if stream == "stderr" else sys.stdout)
                continue
            step = self.displays.accept(tag, item)
            if step.kind == "show":
                if step.shown.tag:
                    step.shown.handle = display.tag_line(step.shown.tag)
                display.publish(item.data, item.metadata)
            elif step.kind == "retag":
                display.retag(step.shown.handle, step.shown.tag)
        self.bars.flush()


def _cell_number(session: SessionFace) -> int:
    """The number every rank gives this cell: the notebook's ``In [N]``, or the one after the
    last given when that is taken (a second request from one notebook cell, or none from a
    shell). Given here, the same to every rank: each rank's own count ran apart from the
    others' once a cell ran on some ranks only (a stack named the same cell 18 on one rank
    and 19 on the others)."""
    number = max(_execution_count() or 0, session.last_cell_number + 1)
    session.last_cell_number = number
    return number


def _execution_count() -> int | None:
    """The running cell's number in the notebook (``In [N]``), when there is a shell: IPython
    has already counted on to the next cell's while this one runs."""
    from IPython import get_ipython

    shell = get_ipython()
    count = getattr(shell, "execution_count", None) if shell is not None else None
    return count - 1 if isinstance(count, int) and count > 1 else None


class _Failure:
    """What RankError needs of a reply that is not a rank's own exception (a request the
    engine cancelled because its rank was released before it began)."""

    def __init__(self, error: Exception):
        self.ename = type(error).__name__
        self.evalue = str(error) or "cancelled before the rank began the cell"
        self.traceback = None


def _as_failure(reply: Exception):
    return reply if hasattr(reply, "ename") else _Failure(reply)
