"""``%dist_status`` after a rank died, from made-up launcher reports (pure logic: no ranks).

The table must say which rank died first and what ended it, show the others as stopped by
the launcher (not as if they had died on their own), give no memory for dead ranks, and say
what to do next, in the words of magics or of Python.
"""

from __future__ import annotations

import dataclasses
import re

from ipydist.notebook import words
from ipydist.notebook.launch import deaths
from ipydist.notebook.reports.status import COLUMNS, status_table
from ipydist.protocol import RankInfo

RANKS = [RankInfo(rank=r, size=4, pid=100 + r, host="a", device="cpu") for r in range(4)]
OMPI_KILL = ("prterun noticed that process rank 2 with PID 102 on node a exited on\n"
             "signal 9 (Killed).")
OMPI_EXIT = ("prterun detected that one or more processes exited with non-zero status,\n"
             "thus causing the job to be terminated. The first process to do so was:\n\n"
             "   Process name: [prterun-a-28422@1,1]\n   Exit code:    3\n")
MPICH_EXIT = ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
              "=   PID 103 RUNNING AT a\n=   EXIT CODE: 7\n=   CLEANING UP REMAINING PROCESSES")


def after(output: str, restart: str = words.MAGICS.restart, launcher: str = "mpiexec"):
    death = deaths.find_death(output, RANKS)
    report = deaths.describe_death(output, RANKS, restart, launcher)
    states = {r: "dead" for r in range(4)}
    return status_table(RANKS, states, {}, death, report, launcher)


def row(table, rank: int) -> dict[str, str]:
    return dict(zip(COLUMNS, next(r for r in table.rows if r[0] == str(rank))))


def test_the_rank_that_died_first_says_how_and_the_others_were_stopped():
    table = after(OMPI_KILL)
    assert row(table, 2)["state"] == "died first: signal 9 (SIGKILL)"
    assert [row(table, r)["state"] for r in (0, 1, 3)] == ["stopped by mpiexec"] * 3
    assert all(row(table, r)["memory"] == "-" for r in range(4))
    text = str(table)
    assert re.search(r"^2\s+a\s+102\s+cpu\s+died first: signal 9 \(SIGKILL\)\s+-$", text,
                     re.MULTILINE), text
    assert max(map(len, text.splitlines()[6:])) <= 88, "the note is wrapped at spaces"
    note = " ".join(text.splitlines()[6:])
    assert note == table.note
    assert note.startswith("rank 2 (pid 102 on a) died: killed by signal 9 (SIGKILL); "
                           "the out-of-memory killer"), note
    assert "mpiexec then stopped ranks 0-1 and 3." in note
    assert note.endswith("Run %dist_restart to start a fresh cluster with the same arguments.")
    page = table._repr_html_()
    assert "<td>died first: signal 9 (SIGKILL)</td>" in page and "%dist_restart" in page


def test_python_sessions_are_told_the_python_call():
    note = after(OMPI_KILL, words.PYTHON.restart).note
    assert "Run Session.restart() to start a fresh cluster" in note and "%dist" not in note


def test_exit_codes_are_read_from_openmpi_and_mpich():
    table = after(OMPI_EXIT)
    assert row(table, 1)["state"] == "died first: exit code 3"
    assert "rank 1 (pid 101 on a) died: exited with code 3." in str(table)
    assert row(after(MPICH_EXIT), 3)["state"] == "died first: exit code 7"
    srun = after("srun: error: a: task 0: Killed\n", launcher="srun")
    assert row(srun, 0)["state"] == "died first: signal 9 (SIGKILL)"
    assert row(srun, 1)["state"] == "stopped by srun"


def test_a_death_the_launcher_did_not_report_names_no_cause():
    table = after("")
    assert row(table, 0)["state"] == "died first"
    assert row(table, 3)["state"] == "stopped by mpiexec"
    one = deaths.find_death("", RANKS[2:3])
    lone = status_table(RANKS, {0: "idle", 1: "busy", 2: "dead", 3: "idle"},
                        {0: "90 MiB", 1: "91 MiB", 3: "93 MiB"}, one, "rank 2 died.")
    assert [row(lone, r)["state"] for r in range(4)] == ["idle", "busy", "died", "idle"]
    assert [row(lone, r)["memory"] for r in range(4)] == ["90 MiB", "91 MiB", "-", "93 MiB"]
    assert lone.caption == "4 ranks; rank 2 dead"


def test_alive_ranks_show_no_note():
    table = status_table(RANKS, dict.fromkeys(range(4), "idle"),
                         {r: f"{90 + r} MiB" for r in range(4)})
    assert table.note == "" and str(table).splitlines()[-1] == "4 ranks"
    assert [r[4] for r in table.rows] == ["idle"] * 4
    assert deaths.find_death("anything", []) is None


def test_the_caption_names_the_replacements():
    ranks = [dataclasses.replace(info, replacement=info.rank == 2) for info in RANKS]
    table = status_table(ranks, dict.fromkeys(range(4), "idle"), {})
    assert table.caption == "4 ranks; rank 2 is a replacement"


def test_a_ranks_memory_is_read_one_way_and_shown_one_way():
    """``%dist_status`` and the live view read a rank's memory by one function and show it by
    one formatter: a live process's resident set; nothing for none, a stand-in of a process
    that is gone, or one that ended between the two looks."""
    import subprocess
    import sys

    import psutil

    from ipydist.notebook.launch import processes
    from ipydist.notebook.live.cluster_state import megabytes

    here = processes.resident_bytes(psutil.Process())
    assert here is not None and here > 1 << 20
    assert megabytes(here).endswith(" MiB") and megabytes(1234 * 2**20) == "1,234 MiB"
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(ended.pid)
    ended.wait()
    assert processes.resident_bytes(proc) is None
    assert processes.resident_bytes(None) is None
    assert processes.resident_bytes(processes.process(2**22 + 12345)) is None
