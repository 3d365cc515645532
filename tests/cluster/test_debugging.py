"""Debugging ranks from Python (``Session.debug``, ``Session.stacks``) on a real 4-rank cluster:
post-mortem on the rank that failed, scripted; every rank's stack while a cell runs, on a quiet
machine and under load. The prompts themselves, through a real Jupyter kernel, are in
``test_debugging_kernel.py``."""

from __future__ import annotations

import re
import threading
import time

import pytest
from helpers import TRIALS, as_merged, run_cell, run_ok

from ipydist.errors import RankError

FAILS_ON_RANKS_2_AND_3 = """%%everyrank
import torch, ipydist.torch as hvd
def failing(r):
    secret = {"rank": r, "squares": [i * i for i in range(4)]}
    if r >= 2:
        raise KeyError(f"boom {r}")
failing(hvd.rank())
"""


def test_session_debug_runs_commands_on_the_failed_rank(shell, capsys, cluster, magics):
    result, out, err = run_cell(shell, capsys, FAILS_ON_RANKS_2_AND_3)
    assert isinstance(result.error_in_exec, RankError), (out, err)
    session = magics.session
    assert session.failed_ranks == [2, 3]
    text = session.debug(commands=["p secret['rank']", "p secret['squares'][3]", "w"])
    assert "(Pdb rank 2) p secret['rank']\n2\n" in text, text
    assert "\n9\n" in text and "failing()" in text, text
    text = session.debug(3, ["p secret"])
    assert "'rank': 3" in text, text
    with pytest.raises(ValueError, match="the ranks are 0..3"):
        session.debug(7, ["q"])
    # the ranks are as they were: every one runs the next cell
    out = run_ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum)"
                                ".item())")
    assert "[all ranks] 4.0" in as_merged(out), out
    with pytest.raises(ValueError, match="no rank raised in the last cell"):
        session.debug(commands=["q"])


def test_dist_debug_without_a_prompt_prints_frames_and_locals(shell, capsys, cluster):
    """Under pytest nobody can type: ``%dist_debug`` says so and shows the frames instead."""
    run_cell(shell, capsys, FAILS_ON_RANKS_2_AND_3)
    out = run_ok(shell, capsys, "%dist_debug")
    assert "nobody can type at a pdb prompt here" in out, out
    assert "rank 2's last error" in out and re.search(r"cell \d+, line 5, in failing", out)
    assert "secret = {'rank': 2, 'squares': [0, 1, 4, 9]}" in out, out
    assert "KeyError: 'boom 2'" in out, out


RANK_3_SLEEPS = """import time, torch, ipydist.torch as hvd
if hvd.rank() == 3:
    time.sleep({seconds})
hvd.allreduce(torch.ones(1))
"""


def stacks_during_a_cell(session, seconds: float = 6.0, after: float = 2.0):
    """``session.stacks()`` taken ``after`` seconds into a cell where rank 3 sleeps while the
    others wait in an allreduce; (the stacks, seconds the call took)."""
    errors = []

    def run():
        try:
            session.run(RANK_3_SLEEPS.format(seconds=seconds))
        except Exception as e:  # reported below
            errors.append(e)

    cell = threading.Thread(target=run)
    cell.start()
    try:
        time.sleep(after)
        t0 = time.monotonic()
        found = session.stacks()
        took = time.monotonic() - t0
    finally:
        cell.join(timeout=60)
    assert not errors, errors
    return found, took


def check_stacks(found) -> None:
    text = str(found)
    assert re.search(r"^rank 3: running: <cell> \(cell \d+, line 3\)$", text, re.M), text
    assert re.search(r"^ranks 0-2: waiting in all_?reduce: ", text, re.M), text
    assert found.by_rank[3]["collective"] is None
    assert {found.by_rank[r]["collective"] for r in range(3)} == {"all_reduce"}, found.by_rank


def test_stacks_while_a_cell_runs(shell, capsys, cluster, magics):
    found, took = stacks_during_a_cell(magics.session)
    check_stacks(found)
    idle = magics.session.stacks()
    assert str(idle) == "ranks 0-3: idle (no cell running)", str(idle)


def test_stacks_while_a_cell_runs_under_load(shell, capsys, cluster, magics, hogs):
    for _ in range(TRIALS):
        found, _ = stacks_during_a_cell(magics.session)
        check_stacks(found)
