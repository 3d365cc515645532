"""No test may signal every process on the machine, nor its own process group.

``os.kill(-1, sig)`` signals every process the caller may signal, which for root (the tests run
as root) is every process on the machine but init: the test run, its runner and CI's own
processes. ``os.kill(0, sig)`` and ``os.killpg`` of the run's own group end the run with them.
A pid of -1 is easily had: ipyparallel's launchers say ``pid == -1`` until their process runs,
and a test that took that for a pid once ended CI after 512 s with nothing but an exit code.
Installed for every test process (conftest.py): such a call raises instead, naming the pid.
"""

from __future__ import annotations

import os

_kill, _killpg = os.kill, os.killpg


def _refused(what: str) -> OSError:
    return PermissionError(f"{what} refused by the tests' signal guard (tests/harness/"
                           "signal_guard.py): a pid of -1 or 0 signals every process on the "
                           "machine or the test run's own process group; was a launcher's pid "
                           "read before its process started?")


def _guarded_kill(pid: int, sig: int) -> None:
    if sig != 0 and pid in (-1, 0, -os.getpgrp()):
        raise _refused(f"os.kill({pid}, {sig})")
    _kill(pid, sig)


def _guarded_killpg(pgid: int, sig: int) -> None:
    if sig != 0 and pgid in (0, 1, os.getpgrp()):
        raise _refused(f"os.killpg({pgid}, {sig})")
    _killpg(pgid, sig)


def install() -> None:
    os.kill, os.killpg = _guarded_kill, _guarded_killpg
