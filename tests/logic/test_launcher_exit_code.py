"""The exit code of a launcher that failed (``notebook.launch.processes.exit_code``), with a real
child process: ipyparallel's launcher waits on the same psutil process in a thread of its own,
and the failed start's message must say the code whichever thread reaps the child.

CI's full run once said "mpiexec exited before the 2 ranks started." without its "(exit code
3)": ipyparallel's thread had reaped mpiexec and not yet stored the code when the notebook
asked, and psutil answered None."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil

from ipydist.notebook.launch import processes


def test_the_code_is_told_when_another_thread_reaped_the_child_and_stores_it_late():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc = psutil.Process(child.pid)
    reaped = threading.Event()

    def launcher_thread():
        # what psutil's Process.wait does in ipyparallel's thread, with the GIL handed over
        # between the reap and the store
        _, status = os.waitpid(child.pid, 0)
        reaped.set()
        time.sleep(0.3)
        proc._exitcode = os.waitstatus_to_exitcode(status)

    thread = threading.Thread(target=launcher_thread)
    thread.start()
    try:
        assert reaped.wait(10)
        assert processes.exit_code(proc) == 3
    finally:
        thread.join(10)
        child.returncode = 3  # reaped above: Popen must not wait for it again


def test_a_child_still_running_has_no_code_and_is_not_waited_for():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        t0 = time.monotonic()
        assert processes.exit_code(psutil.Process(child.pid)) is None
        assert time.monotonic() - t0 < 0.5
    finally:
        child.kill()
        child.wait(10)


def test_a_child_that_exited_has_its_code_at_once():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(5)"])
    proc = psutil.Process(child.pid)
    while processes.alive(proc):
        time.sleep(0.01)
    assert processes.exit_code(proc) == 5
    child.returncode = 5
