"""A rank ends when its launcher is gone
(``ipydist.rank.start.bootstrap.end_with_launcher``, issue 46): a real parent process is
SIGKILLed, and its child, which watches it, ends by itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from helpers import wait_gone

#: The launcher stand-in: starts the "rank" (the guard, then a long sleep), says the rank's pid
#: once the rank's guard runs, waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                            stderr=open(sys.argv[2], "w"), text=True)
    assert rank.stdout.readline() == "guarded\\n"
    print(rank.pid, flush=True)
    time.sleep(120)
""")
RANK = textwrap.dedent("""
    import os, time
    os.environ["OMPI_COMM_WORLD_RANK"] = "3"
    from ipydist.rank.start.bootstrap import end_with_launcher
    end_with_launcher(poll=0.05)
    print("guarded", flush=True)
    time.sleep(120)
""")


def test_a_rank_ends_soon_after_its_launcher_is_killed(tmp_path):
    err = tmp_path / "rank.err"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(err)],
                                stdout=subprocess.PIPE, text=True)
    try:
        rank = int(launcher.stdout.readline())
        assert wait_gone([rank], timeout=0.1) == [rank], "the rank runs while its launcher does"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        left = wait_gone([rank], timeout=5)
    finally:
        launcher.kill()
        launcher.wait(10)
    if left:
        os.kill(rank, signal.SIGKILL)
    assert left == [], "the rank still ran 5 s after its launcher was killed"
    said = err.read_text()
    assert f"ipydist: rank 3 (pid {rank}) ends: its launcher (pid {launcher.pid}) is gone" in said
