"""What the suite stands on: the turns between pytest-xdist's workers
(tests/harness/worker_turns.py), with real processes and real locks: an ``alone`` test overlaps
no other test, the others overlap each other, and the hosts tier is one worker group; and the
summary's times (tests/harness/suite_watch.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import suite_watch
import worker_turns


def _worker(folder: str, name: str, plan: list[tuple[bool, float]], log) -> None:
    os.environ[worker_turns.TURNS_VAR] = folder
    os.environ["PYTEST_XDIST_WORKER"] = name
    for i, (alone, seconds) in enumerate(plan):
        keep = i + 1 < len(plan) and plan[i + 1][0]  # as conftest.py: the next is alone too
        with worker_turns.turn(alone, keep=alone and keep):
            start = time.monotonic()
            time.sleep(seconds)
            log.put((name, alone, start, time.monotonic()))


def _run_workers(tmp_path, plans: dict) -> list[tuple]:
    """Run each plan in a worker process of its own, side by side; the tests' (worker, alone,
    start, end), as they ran."""
    ctx = multiprocessing.get_context("fork")
    log = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), n, p, log))
             for n, p in plans.items()]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return [log.get(timeout=5) for _ in range(sum(len(p) for p in plans.values()))]


def test_an_alone_test_overlaps_no_other_and_the_others_overlap(tmp_path):
    # two workers keep running short tests; the third asks for its turn alone in between
    plans = {"gw0": [(False, 0.05)] * 30, "gw1": [(False, 0.05)] * 30,
             "gw2": [(False, 0.05), (True, 0.3), (False, 0.05)]}
    runs = _run_workers(tmp_path, plans)
    alone = [r for r in runs if r[1]]
    others = [r for r in runs if not r[1]]
    assert len(alone) == 1
    _, _, a0, a1 = alone[0]
    overlapping = [r for r in others if r[2] < a1 and a0 < r[3]]
    assert overlapping == [], overlapping
    # without the alone one, tests of different workers did run side by side
    assert any(x[0] != y[0] and x[2] < y[3] and y[2] < x[3] for x in others for y in others)


def test_alone_tests_in_a_row_keep_their_turn_and_their_waits_are_told(tmp_path, monkeypatch):
    # one worker keeps running short tests; the other runs three alone tests in a row
    plans = {"gw0": [(False, 0.05)] * 40, "gw1": [(False, 0.05), (True, 0.2), (True, 0.2),
                                                   (True, 0.2), (False, 0.05)]}
    runs = _run_workers(tmp_path, plans)
    alone = sorted(r for r in runs if r[1])
    first, last = min(r[2] for r in alone), max(r[3] for r in alone)
    between = [r for r in runs if not r[1] and r[2] < last and first < r[3]]
    assert between == [], "another worker's test ran between alone tests in a row"
    monkeypatch.setenv(worker_turns.TURNS_VAR, str(tmp_path))
    waits = worker_turns.waits()
    assert len(waits) == 1, "the second and third took the first's turn without waiting"
    assert 0 <= waits[0] < 5


def test_nothing_is_locked_in_a_run_of_one_process(monkeypatch):
    monkeypatch.delenv(worker_turns.TURNS_VAR, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    with worker_turns.turn(alone=True), worker_turns.turn(alone=True):
        pass  # a second exclusive turn inside the first would wait for ever if it locked


def test_each_file_is_a_group_and_the_hosts_tier_is_one():
    assert worker_turns.group_of("tests/cluster/test_x.py::test_a[1]") == "tests/cluster/test_x.py"
    assert worker_turns.group_of("tests/hosts/test_slurm.py::test_b") == "tests/hosts"
    assert worker_turns.group_of("tests/hosts/test_multihost.py::test_c") == "tests/hosts"


def test_the_summary_s_minutes_round_before_they_split():
    assert suite_watch._mmss(179.97) == "3:00.0"
    assert suite_watch._mmss(61.24) == "1:01.2"
    assert suite_watch._mmss(0.04) == "0:00.0"


def test_each_test_is_charged_the_cpu_from_its_start_to_the_next(monkeypatch, tmp_path):
    busy = iter([10.0, 13.0, 14.5, 20.0])
    monkeypatch.setattr(suite_watch, "_busy_seconds", lambda: next(busy))
    clock = suite_watch.CpuClock()
    for nodeid in ["tests/cluster/a.py::t1", "tests/cluster/a.py::t2",
                   "tests/hosts/b.py::t3", None]:
        clock.at(nodeid)
    assert clock.by_test == {"tests/cluster/a.py::t1": 3.0, "tests/cluster/a.py::t2": 1.5,
                             "tests/hosts/b.py::t3": 5.5}
    assert clock.by_file == {"tests/cluster/a.py": 4.5, "tests/hosts/b.py": 5.5}
    clock.save(tmp_path / "cpu.json")
    assert list(json.loads((tmp_path / "cpu.json").read_text())) == [
        "tests/hosts/b.py::t3", "tests/cluster/a.py::t1", "tests/cluster/a.py::t2"]
    assert "  0:05.5  tests/hosts/b.py::t3" in clock.lines()


def test_as_merged_reads_every_rank_s_tagged_copy_of_a_line_as_one_merged_line():
    from helpers import as_merged

    apart = "[rank 1] alive 4.0\n[rank 2] alive 4.0\n[rank 3] alive 4.0\n[rank 0] alive 4.0\n"
    assert as_merged(apart) == "[all ranks] alive 4.0\n"
    # what not every rank printed stays tagged, in its place; merged lines stay as they are
    mixed = ("[rank 0] start on 0\n[all ranks] same\n[rank 1] x\n[rank 0] x\n[rank 2] x\n"
             "[rank 1] start on 1\n")
    assert as_merged(mixed) == mixed
    assert as_merged(mixed + "[rank 3] x\n") == (
        "[rank 0] start on 0\n[all ranks] same\n[all ranks] x\n[rank 1] start on 1\n")
    assert as_merged("[rank 0] a\n[rank 1] a", np=2) == "[all ranks] a\n"
    assert as_merged("[rank 0] a\n[rank 0] a\n", np=2) == "[rank 0] a\n[rank 0] a\n"
