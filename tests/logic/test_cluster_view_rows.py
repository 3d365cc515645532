"""The live cluster view's rows (pure logic of ``ipydist.notebook.live.cluster_state``)."""

from __future__ import annotations

from ipydist.notebook.live.cluster_state import RunningCell, row, state_of
from ipydist.protocol import RankInfo

INFO = RankInfo(rank=2, size=4, host="node1", pid=4242)


def test_what_a_rank_does():
    cell = RunningCell(7, [0, 1, 2, 3])
    assert state_of(2, "idle", None, None, False) == ("idle", "idle")
    assert state_of(2, "busy", None, cell, False) == ("running", "running cell 7")
    assert state_of(2, "busy", {"collective": None}, cell, False) == ("running", "running cell 7")
    waiting = {"collective": "all_reduce", "waited": 12.4}
    assert state_of(2, "busy", waiting, cell, False) == (
        "waiting", "waiting in all_reduce for 12 s")
    assert state_of(2, "busy", {"collective": None, "debugger": True}, cell, False)[0] == (
        "debugger")
    assert state_of(2, "dead", waiting, cell, False) == ("dead", "dead")
    assert state_of(2, "idle", None, None, True) == ("idle", "idle, replaced")
    assert state_of(2, "busy", None, RunningCell(8, [0]), False) == ("busy", "busy"), (
        "a rank the cell does not run on, yet busy (a queued request)")


def test_the_ranks_own_numbers_win_over_the_notebooks():
    vitals = {"collective": None, "cpu": 97.6, "rss": 512 * 2**20, "step": 0.0123,
              "gpu": {"util": 88, "used": 3 * 2**30, "total": 80 * 2**30}}
    shown = row(INFO, "busy", vitals, {"cpu": 5.0, "rss": 1}, RunningCell(3, [2]), False)
    assert (shown["cpu"], shown["memory"], shown["step"]) == ("98 %", "512 MiB", "12.3 ms")
    assert shown["gpu"] == "88 % · 3.0/80 GiB"
    here = row(INFO, "idle", None, {"cpu": 1.2, "rss": 300 * 2**20}, None, False)
    assert (here["cpu"], here["memory"], here["gpu"], here["step"]) == ("1 %", "300 MiB", "", "")
    elsewhere = row(INFO, "idle", None, None, None, False)
    assert (elsewhere["cpu"], elsewhere["memory"]) == ("", "")
    dead = row(INFO, "dead", None, {"cpu": 1.0, "rss": 5}, None, False)
    assert (dead["state"], dead["cpu"], dead["memory"]) == ("dead", "", "")
