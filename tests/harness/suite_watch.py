"""What the whole suite checks and says at its end (tests/conftest.py calls these hooks' parts):
how long each tier took and which files took longest, so that the change that slows one is
seen at once; how many clusters each file started (the largest cost); and that no process a test
started is left running.

The suite runs in several processes at once (pytest-xdist, ``make test``): the reports reach
the main process, which adds them up here. A tier's wall time runs from its first test's start
to its last test's end, whatever else ran beside it; its test time adds up its tests' own
(setup, call and teardown), which is what one process alone would have taken.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import psutil
import pytest
from helpers import MARK_VAR, kill_left, of_this_run

#: The tiers in the order ``make test`` hands them out: the pure logic first (some of its tests
#: use the worker's shell, and expect it with no cluster yet), then the longest files (the
#: namespace hosts and Slurm, the browser), then the one-host clusters, whose many short files
#: fill the gaps at the end.
TIER_ORDER = ("logic", "hosts", "browser", "cluster")


def with_workers(config) -> bool:
    """Whether pytest-xdist runs this suite in several processes (``-n N``, N > 0)."""
    return bool(getattr(config.option, "numprocesses", None))


def tier_of(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def longest_first(items) -> None:
    """Sort ``items`` by tier (:data:`TIER_ORDER`), keeping each file's own order, so that
    ``--dist loadfile`` starts the long files early, not at the end beside idle workers."""
    rank = {tier: i for i, tier in enumerate(TIER_ORDER)}
    items.sort(key=lambda item: rank.get(tier_of(item.nodeid), len(rank)))


@dataclass
class Tier:
    tests: int = 0
    seconds: float = 0.0
    first: float = float("inf")
    last: float = 0.0


class TierClock:
    """Collects the reports of every test, from whichever process ran it."""

    def __init__(self) -> None:
        self.tiers: dict[str, Tier] = {}
        self.files: dict[str, float] = {}  # a test file -> its tests' time
        self.started = time.time()

    def add(self, report) -> None:
        tier = self.tiers.setdefault(tier_of(report.nodeid), Tier())
        tier.seconds += report.duration
        path = report.nodeid.split("::")[0]
        self.files[path] = self.files.get(path, 0.0) + report.duration
        tier.tests += report.when == "call" or (report.when == "setup" and report.skipped)
        stop = getattr(report, "stop", time.time())
        tier.first = min(tier.first, getattr(report, "start", stop - report.duration))
        tier.last = max(tier.last, stop)

    def lines(self) -> list[str]:
        """One line per tier, in the order they started."""
        out = []
        for name, t in sorted(self.tiers.items(), key=lambda kv: kv[1].first):
            out.append(f"{name:8} {t.tests:5d} tests  {_mmss(t.last - t.first)} from its first "
                       f"test to its last (at {_mmss(t.first - self.started)} to "
                       f"{_mmss(t.last - self.started)}), {_mmss(t.seconds)} of test time")
        out.append(f"{'all':8} {sum(t.tests for t in self.tiers.values()):5d} tests  "
                   f"{_mmss(time.time() - self.started)} in all")
        return out

    def longest_files(self, count: int = 12) -> list[str]:
        """The ``count`` test files that took longest (setup, call and teardown of their
        tests): where the suite's time goes."""
        ranked = sorted(self.files.items(), key=lambda kv: -kv[1])[:count]
        return [f"{_mmss(seconds)}  {path}" for path, seconds in ranked]


def _mmss(seconds: float) -> str:
    """``m:ss.s``, rounded before it is split (179.97 s is 3:00.0, not 2:60.0)."""
    tenths = round(seconds * 10)
    return f"{tenths // 600}:{tenths % 600 / 10:04.1f}"


def leftover_processes(wait: float = 10.0) -> dict[int, str]:
    """The processes that a test started (ranks, mpiexecs, controllers and their schedulers,
    kernels, namespace hosts: their environment carries a mark of this run, a test process's or
    a test kernel's: ``helpers.of_this_run``) still running ``wait`` seconds after the last
    test; killed, so that nothing outlives the suite. This process and its own children
    (pytest-xdist's workers, whose marks extend its own) are not counted."""
    me = psutil.Process()
    ours = {me.pid, *(child.pid for child in me.children())}
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] in ours:
            continue
        try:
            if of_this_run(p.environ().get(MARK_VAR, "")):
                found[p.info["pid"]] = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
    return kill_left(found, wait)


#: The names a launcher's process has (Open MPI's mpiexec is prterun; MPICH's gforker and hydra;
#: Slurm's): one appears per cluster start or restart.
LAUNCHERS = frozenset({"mpiexec", "mpirun", "prterun", "mpiexec.gforker", "mpiexec.hydra",
                       "srun", "salloc"})


class LaunchCounter:
    """Counts the clusters each test file starts: a thread looks for new launcher processes
    that a test started (:data:`MARK_VAR`) every ``every`` seconds, and counts each for the test
    running then. Starting a cluster is the suite's largest cost (four ranks importing torch on
    two cores), so these counts say where sharing one would pay. A launcher that lives less
    than ``every`` (a start refused at once) may be missed: the counts are lower bounds."""

    def __init__(self, every: float = 0.5) -> None:
        self.current = "(before the first test)"
        self.by_file: dict[str, int] = {}
        self._seen: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every,), daemon=True,
                                        name="suite-launch-counter")
        self._thread.start()

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            for p in psutil.process_iter(["pid", "name", "create_time"]):
                key = (p.info["pid"], p.info["create_time"])
                if p.info["name"] not in LAUNCHERS or key in self._seen:
                    continue
                self._seen.add(key)
                try:
                    marked = of_this_run(p.environ().get(MARK_VAR, ""))
                except psutil.Error:
                    continue
                if marked:
                    path = self.current.split("::")[0]
                    self.by_file[path] = self.by_file.get(path, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def lines(self, count: int = 12) -> list[str]:
        ranked = sorted(self.by_file.items(), key=lambda kv: -kv[1])[:count]
        return [f"cluster starts seen: {sum(self.by_file.values())}, most by:",
                *(f"  {n:3d}  {path}" for path, n in ranked)]


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since it started (every core, every
    process): what the suite's processes cost, ranks and browsers included."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) \
        - getattr(t, "guest_nice", 0.0)


class CpuClock:
    """The machine's busy CPU seconds while each test file ran, in a run of one process (with
    several workers, files run side by side and no file's share can be told): on 2 cores the
    suite is bound by the CPU, so these, not wall times, say what a change to a file saves."""

    def __init__(self) -> None:
        self.by_file: dict[str, float] = {}
        self.by_test: dict[str, float] = {}
        self._test: str | None = None
        self._since = 0.0

    def at(self, nodeid: str | None) -> None:
        """A test starts (``nodeid``) or the last one ended (None): the one before is charged
        from its start until now, its module's fixtures and the teardown of the test before it
        included."""
        now = _busy_seconds()
        if self._test is not None:
            spent = now - self._since
            path = self._test.split("::")[0]
            self.by_file[path] = self.by_file.get(path, 0.0) + spent
            self.by_test[self._test] = self.by_test.get(self._test, 0.0) + spent
        self._test, self._since = nodeid, now

    def save(self, path) -> None:
        """Every test's busy CPU seconds, most first, as JSON (``make test`` leaves it in
        .pytest_cache/ipydist-cpu.json): where the next cut would pay."""
        ranked = sorted(self.by_test.items(), key=lambda kv: -kv[1])
        path.write_text(json.dumps({k: round(v, 2) for k, v in ranked}, indent=0))

    def lines(self, count: int = 15) -> list[str]:
        by_tier: dict[str, float] = {}
        for path, cpu in self.by_file.items():
            by_tier[tier_of(path)] = by_tier.get(tier_of(path), 0.0) + cpu
        ranked = sorted(self.by_file.items(), key=lambda kv: -kv[1])[:count]
        tests = sorted(self.by_test.items(), key=lambda kv: -kv[1])[:count]
        return ["busy CPU (all cores) per tier: " + ", ".join(
                    f"{tier} {_mmss(cpu)}" for tier, cpu in sorted(by_tier.items(),
                                                                   key=lambda kv: -kv[1])),
                "most busy CPU, by file:",
                *(f"  {_mmss(cpu)}  {path}" for path, cpu in ranked),
                "most busy CPU, by test (all in .pytest_cache/d/ipydist/cpu-per-test.json):",
                *(f"  {_mmss(cpu)}  {nodeid}" for nodeid, cpu in tests)]


class SuiteWatch:
    """The plugin (registered by tests/conftest.py in the main process): the reports of every
    test add up in a :class:`TierClock`; at the end, the leftovers are looked for, and both
    are said in the summary. ``turn_waits`` says how long the alone tests waited for their
    turns (worker_turns.waits: handed in, since worker_turns imports this module)."""

    def __init__(self, turn_waits=lambda: []) -> None:
        self.turn_waits = turn_waits
        self.clock = TierClock()
        self.starts = LaunchCounter()
        self.cpu = CpuClock()
        self.left: dict[int, str] = {}

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        self.starts.current = nodeid
        self.cpu.at(nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        self.clock.add(report)

    def pytest_sessionfinish(self, session) -> None:
        self.cpu.at(None)
        cache = getattr(session.config, "cache", None)  # None under -p no:cacheprovider
        if self.cpu.by_test and cache is not None and not with_workers(session.config):
            self.cpu.save(cache.mkdir("ipydist") / "cpu-per-test.json")
        self.starts.stop()
        self.left = leftover_processes()
        if self.left and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.left:
            terminalreporter.section("processes left running", red=True)
            terminalreporter.line(f"still running 10 s after the last test (killed): "
                                  f"{self.left}")
        if self.clock.tiers:
            terminalreporter.section("time per tier")
            for line in self.clock.lines():
                terminalreporter.line(line)
            terminalreporter.line("longest files:")
            for line in self.clock.longest_files():
                terminalreporter.line("  " + line)
            for line in self.starts.lines():
                terminalreporter.line(line)
            waits = self.turn_waits()
            if waits:
                terminalreporter.line(
                    f"alone tests: {len(waits)} waited {sum(waits):.1f} s in all for their "
                    f"turns (the longest {max(waits):.1f} s), a core idle meanwhile")
            if not with_workers(terminalreporter.config):
                for line in self.cpu.lines():
                    terminalreporter.line(line)
