"""One ``%%everyrank`` cell in flight: waiting for the ranks while showing what they send.

The wait loop runs in the notebook's main thread and wakes every 50 ms: it prints the ranks'
output (merged by :class:`LineMerger`), feeds their metrics to the history and the live view,
and enforces ``--timeout``. Ctrl-C (the stop button) lands here too, and interrupts the ranks.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from ipydist import report
from ipydist.errors import CellTimeout, RankError
from ipydist.live.view import LiveView
from ipydist.output import LineMerger, OutputCollector
from ipydist.specs import describe_ranks

#: How often the wait loop wakes to show output and metrics.
POLL_SECONDS = 0.05
#: After the ranks replied, how long to wait for more of their output when none is coming.
OUTPUT_STALL_SECONDS = 2.0


@dataclass
class RunResult:
    """What a cell produced, beyond the output already shown."""

    ranks: list[int]
    execute_results: dict[int, dict] = field(default_factory=dict)
    elapsed: float = 0.0


class CellRun:
    def __init__(self, session, async_result, targets: list[int], output: str,
                 timeout: float | None, started: float):
        self.session = session
        self.ar = async_result
        self.targets = targets
        self.started = started
        self.deadline = None if not timeout else started + float(timeout)
        self.timeout = timeout
        self.collector = OutputCollector(async_result, targets)
        self.shown = targets if output == "all" else targets[:1]
        self.merger = LineMerger(self.shown)
        self.live = LiveView(session.metrics, session.size)
        self.result = RunResult(targets)

    def wait(self) -> RunResult:
        """Block until every rank finished the cell; raise RankError if any raised."""
        ar = self.ar
        try:
            while not ar.wait(POLL_SECONDS):
                self._show()
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    running = self.session._interrupt(ar, self.targets)
                    raise CellTimeout(
                        f"the cell ran past --timeout {self.timeout:g} s; interrupted "
                        f"{describe_ranks(running)}."
                    )
            self._wait_for_output()
        except KeyboardInterrupt:
            running = self.session._interrupt(ar, self.targets)
            print(f"Interrupted {describe_ranks(running)}.", file=sys.stderr)
            raise
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
            raise RankError(failures)
        return self.result

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
            elif ev.kind == "metrics":
                self.session.metrics.accept(ev.rank, ev.content)
            elif ev.kind == "display_data" and ev.rank == self.shown[0]:
                report.publish(ev.content.get("data", {}), ev.content.get("metadata"))
        _print_lines(self.merger.release())
        self.live.update()
        return len(events)


def _print_lines(lines) -> None:
    for tag, stream, line in lines:
        print(f"[{tag}] {line}", end="", file=sys.stderr if stream == "stderr" else sys.stdout)
