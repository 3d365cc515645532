"""One ``%%everyrank`` cell in flight: waiting for the ranks while showing what they send.

The wait loop runs in the notebook's main thread and wakes every 50 ms: it prints the ranks'
output (merged by :class:`LineMerger`), feeds their metrics to the history and the live view,
warns of a stall (some ranks waiting in a collective the others never entered: see
:mod:`ipydist.notebook.stall`), and enforces ``--timeout``. Ctrl-C (the stop button) lands here too,
and interrupts the ranks.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from ipydist.errors import CellInterrupted, CellTimeout, ClusterError, RankDied, RankError
from ipydist.notebook import display, ipp, recovery
from ipydist.notebook.iopub import IOPubCollector
from ipydist.notebook.lines import LineMerger
from ipydist.notebook.live.view import LiveView
from ipydist.notebook.stall import StallWatch
from ipydist.specs import describe_ranks

#: How often the wait loop wakes to show output and metrics.
POLL_SECONDS = 0.05
#: How often the wait loop checks that every rank's process is still there.
ALIVE_CHECK_SECONDS = 0.5
FIRST_ALIVE_CHECK_SECONDS = 0.1
#: After the ranks replied, how long to wait for more of their output when none is coming.
OUTPUT_STALL_SECONDS = 2.0


@dataclass
class RunResult:
    """What a cell produced, beyond the output already shown."""

    ranks: list[int]
    execute_results: dict[int, dict] = field(default_factory=dict)
    elapsed: float = 0.0


class CellRun:
    """One cell on ``targets`` (sent as ``async_result``) until every rank has replied."""

    def __init__(self, session, async_result, targets: list[int], output: str,
                 timeout: float | None, started: float):
        self.session = session
        self.cluster = session.cluster
        self.ar = async_result
        self.targets = targets
        self.started = started
        self.deadline = None if not timeout else started + float(timeout)
        self.timeout = timeout
        self.collector = IOPubCollector(async_result, targets)
        self.shown = targets if output == "all" else targets[:1]
        self.merger = LineMerger(self.shown)
        self.live = LiveView(session.metrics, session.size)
        self.result = RunResult(targets)
        self.stalls = StallWatch(targets, session.stall_warning, session.words.timeout)
        #: A failing rank's peers get this long to finish by themselves before release.
        self.failure_grace = float(timeout) if timeout else session.failure_grace
        self.first_failure: tuple[int, float] | None = None  # (rank, when)
        self.release = recovery.Release(self.cluster)
        #: Ranks released because another failed: their errors are a consequence.
        self.released: list[int] = []

    def wait(self) -> RunResult:
        """Block until every rank finished the cell; raise RankError if any raised."""
        ar = self.ar
        try:
            # a rank that died: first checked soon (a cell sent to a dead cluster), then every
            # ALIVE_CHECK_SECONDS; a cell that ends sooner costs nothing
            next_alive_check = time.monotonic() + FIRST_ALIVE_CHECK_SECONDS
            while not ar.wait(POLL_SECONDS):
                self._show()
                self._contain_failure()
                self._warn_of_stall()
                if time.monotonic() >= next_alive_check:
                    if death := self.session.death_report():
                        raise RankDied(death)
                    if not self.cluster.controller_alive():
                        raise ClusterError(
                            f"the ipyparallel controller (pid {self.cluster.controller_pid}) is "
                            "gone, so the ranks can no longer be reached. Run "
                            f"{self.session.words.restart} to start a fresh cluster.")
                    next_alive_check = time.monotonic() + ALIVE_CHECK_SECONDS
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    running = recovery.interrupt(self.release, ar, self.targets)
                    if self.first_failure is not None and ar.ready():
                        # a rank raised before the deadline: its error is the story, and the
                        # others were released as after the failure grace
                        self.released = sorted(set(self.released) | set(running))
                        break
                    notes = self._recover(running)
                    raise CellTimeout(" ".join([
                        f"the cell ran past --timeout {self.timeout:g} s; interrupted "
                        f"{describe_ranks(running)}.", *notes]))
            self._wait_for_output()
        except KeyboardInterrupt:
            running = recovery.interrupt(self.release, ar, self.targets)
            notes = self._recover(running)
            raise CellInterrupted(
                " ".join([f"Interrupted {describe_ranks(running)}.", *notes])) from None
        finally:
            self.collector.finish()
            self._show()
            _print_lines(self.merger.flush())
            self.live.finish()
        self.result.elapsed = time.perf_counter() - self.started
        replies = ar.get(return_exceptions=True)
        failures = {
            rank: reply for rank, reply in zip(self.targets, replies)
            if isinstance(reply, Exception)
        }
        if failures:
            notes = self._recover(self.released)
            # the rank that failed while others still ran goes first; otherwise rank order
            first = self.first_failure[0] if self.first_failure and self.released else None
            raise RankError(failures, first=first, released=self.released, notes=notes)
        return self.result

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
        running = ipp.still_running(self.ar, self.targets)
        if not running or not self.release.due(now):
            return
        blocked = all(rank in self.stalls.waiting for rank in running)
        if blocked or now >= self.first_failure[1] + self.failure_grace:
            self.release.send(running, now)
            self.released = self.release.ranks

    def _recover(self, released: list[int]) -> list[str]:
        return recovery.recover(self.cluster, released, self.session.words.restart)

    def _warn_of_stall(self) -> None:
        if not self.stalls.waiting:
            return
        doing = ipp.outcomes(self.ar, self.targets)
        if warning := self.stalls.check(time.monotonic(), doing):
            _print_lines(self.merger.ready(now=float("inf")))  # what came before goes first
            print(warning, file=sys.stderr, flush=True)

    def _wait_for_output(self) -> None:
        """The ranks replied; their output may still be on its way (a backlog of a million
        metric points takes seconds to unpack). Keep showing it until it is complete, or until
        none has arrived for OUTPUT_STALL_SECONDS, so a rank that died mid-output cannot hang
        the cell."""
        last_arrival = time.monotonic()
        while not self.ar.wait_for_output(POLL_SECONDS):
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
            elif ev.kind == "metrics":
                self.session.metrics.accept(ev.rank, ev.content)
            elif ev.kind == "display_data" and ev.rank == self.shown[0]:
                display.publish(ev.content.get("data", {}), ev.content.get("metadata"))
        _print_lines(self.merger.ready())
        self.live.update()
        return len(events)


def _print_lines(lines) -> None:
    for tag, stream, line in lines:
        print(f"[{tag}] {line}", end="", file=sys.stderr if stream == "stderr" else sys.stdout)
