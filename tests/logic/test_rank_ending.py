"""A rank's process ends without tearing Python down (ipydist/rank/ending.py), yet as Python's
own exit is seen from outside: its exit code, atexit callbacks, files left open flushed,
non-daemon threads waited for, an escaping exception printed. In a child Python, since the
end is ``os._exit``."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import atexit, sys, threading, time
from ipydist.rank import ending

def main():
    kept = open(sys.argv[1] + "/open.txt", "w")
    kept.write("written, never closed")
    atexit.register(lambda: open(sys.argv[1] + "/atexit.txt", "w").write("ran"))
    threading.Thread(target=lambda: (time.sleep(0.3),
                                     open(sys.argv[1] + "/thread.txt", "w").write("done"))
                     ).start()
    print("to stdout", end="")
    {end}

ending.run_then_exit(main)
"""


@pytest.mark.parametrize("end, code, stderr", [
    ("", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit('a message')", 1, "a message"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
])
def test_the_end_is_seen_as_python_s_own(tmp_path, end, code, stderr):
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(end=end), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout == "to stdout"
    assert stderr in done.stderr
    assert (tmp_path / "open.txt").read_text() == "written, never closed"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "done"
