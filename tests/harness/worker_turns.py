"""Turns between pytest-xdist's workers: which tests share a worker, and a test marked ``alone``
runs with no other test beside it, the others side by side.

A few tests hold a bar set for a quiet machine (a heal within 10 s of the kill, as the issue
that built it promised). Beside the other workers' ranks importing torch on the same 2 cores,
such a bar measures the neighbours, not ipydist (11.6 s, once). Each test takes a shared lock
for its whole run (setup, call and teardown, so a module's cluster start too); an ``alone`` one
takes it exclusively, after closing a gate that keeps new tests from starting meanwhile (else
the workers' shared turns, one after another, could keep it waiting for ever). In a run of one
process there is nobody to wait for, and nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time

from suite_watch import tier_of

#: The folder of the run's two lock files, made by the main process before the workers start
#: (they inherit it); unset in a run of one process.
TURNS_VAR = "IPYDIST_TEST_TURNS"


def group_of(nodeid: str) -> str:
    """The worker group of a test (pytest-xdist's ``--dist loadgroup``): its file, so that a
    module's fixtures (its clusters) are made once; but every test of ``tests/hosts`` in one,
    since their namespace hosts take one address range and one Slurm's ports, one cluster of
    them at a time."""
    return "tests/hosts" if tier_of(nodeid) == "hosts" else nodeid.split("::")[0]


def make_folder() -> None:
    """In the main process of a run with workers: the folder of the lock files, for them all."""
    os.environ[TURNS_VAR] = tempfile.mkdtemp(prefix="ipydist-turns-")


def remove_folder() -> None:
    folder = os.environ.pop(TURNS_VAR, None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


#: The exclusive turn this worker kept from one ``alone`` test for the next (its open lock
#: files), or None.
_kept: tuple | None = None


@contextlib.contextmanager
def turn(alone: bool, keep: bool = False):
    """Hold this worker's turn for one test: exclusive when ``alone``, shared otherwise.

    ``keep`` (for an alone test whose worker's next test is alone too): the exclusive turn is
    kept for that one. Otherwise the other workers start a test in between, and the next alone
    test waits for it to end with a core idle (test_under_load.py has five in a row)."""
    global _kept
    folder = os.environ.get(TURNS_VAR)
    if not folder:
        yield
        return
    if _kept is not None:
        gate, room = _kept
        _kept = None
    else:
        gate = open(os.path.join(folder, "gate"), "a")  # closed below
        room = open(os.path.join(folder, "room"), "a")
        if alone:
            started = time.monotonic()
            fcntl.flock(gate, fcntl.LOCK_EX)  # no test starts from now on
            fcntl.flock(room, fcntl.LOCK_EX)  # the running ones end
            _note_wait(folder, time.monotonic() - started)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)  # waits while an alone test goes first
            fcntl.flock(room, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        if keep:
            _kept = gate, room
        else:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
            gate.close()
            room.close()


def _note_wait(folder: str, seconds: float) -> None:
    """Add the seconds an alone test waited for its turn to the run's tally (one line each,
    appended whole)."""
    with open(os.path.join(folder, "waits"), "a") as tally:
        tally.write(f"{seconds:.3f}\n")


def waits() -> list[float]:
    """In the main process, at the end: the seconds each alone test waited for its turn (the
    other workers' tests ending, the cores half idle meanwhile)."""
    folder = os.environ.get(TURNS_VAR)
    try:
        with open(os.path.join(folder or "", "waits")) as tally:
            return [float(line) for line in tally if line.strip()]
    except OSError:
        return []
