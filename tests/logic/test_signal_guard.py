"""A pid of -1 never reaches a signal: ipyparallel's launchers say -1 until their process runs
(a test once took it for the controller's pid and, as root, killed every process on the machine,
CI's runner included), and the tests' guard refuses such a signal from any test process."""

from __future__ import annotations

import os
import signal

import pytest
from ipyparallel.cluster.launcher import LocalControllerLauncher

from ipydist.notebook.launch import processes


def test_a_launcher_whose_process_has_not_started_has_no_pid():
    launcher = LocalControllerLauncher()
    assert launcher.pid == -1  # ipyparallel's own placeholder: the reason for started_pid
    assert processes.started_pid(launcher) is None
    assert processes.started_pid(None) is None
    launcher.pid = os.getpid()
    assert processes.started_pid(launcher) == os.getpid()


@pytest.mark.parametrize("call", [lambda: os.kill(-1, signal.SIGURG),
                                  lambda: os.kill(0, signal.SIGURG),
                                  lambda: os.killpg(os.getpgrp(), signal.SIGURG)],
                         ids=["kill -1", "kill 0", "killpg own group"])
def test_the_guard_refuses_a_signal_to_everyone_or_to_the_run(call):
    # SIGURG: ignored by default, so that a guard that failed would harm nothing
    with pytest.raises(PermissionError, match="refused by the tests' signal guard"):
        call()
    os.kill(os.getpid(), 0)  # a plain check still passes
