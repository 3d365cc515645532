"""No orphans, ever (issue 5, item 5): after the notebook kernel is shut down, restarted, or
killed with SIGKILL, no controller, mpiexec or rank of its cluster is left after 10 s.

These start a real Jupyter kernel through jupyter_client, as JupyterLab does, and check pids.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from helpers import RANK_COMMAND, wait_gone
from jupyter_client.manager import start_new_kernel

from ipydist.protocol import HEAL_FILE_PREFIX, HEAL_SHARED_MEMORY

START = "%load_ext ipydist\n%dist_start --np 2"
PIDS = """
import json, ipydist
_s = get_ipython().magics_manager.registry["DistMagics"].session
print("PIDS", json.dumps(_s.cluster.pids() + [_s.cluster.watchdog_pid()]))
"""


def run(client, code: str, timeout: float = 120) -> str:
    """Execute ``code`` in the kernel; return what it printed (fail on an error)."""
    out = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


@pytest.fixture
def kernel_with_cluster():
    """A kernel running a 2-rank cluster; yields (manager, client, the cluster's pids)."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        run(kc, START)
        text = run(kc, PIDS)
        pids = json.loads(text.split("PIDS", 1)[1])
        ranks = [p for p in pids if RANK_COMMAND in " ".join(_cmdline(p))]
        assert len(ranks) >= 2, f"expected 2 ranks among {pids}"
        yield km, kc, pids
    finally:
        kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _assert_all_gone(pids: list[int]) -> None:
    left = wait_gone(pids, timeout=10)
    for pid in left:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert left == [], f"still running 10 s later: {[_cmdline(p) for p in left]}"


def test_kernel_killed_with_sigkill_leaves_nothing(kernel_with_cluster):
    """Nor the file a heal's copy was writing when the kernel died (its rank killed by the
    watchdog: no rank is left to remove it)."""
    km, _, pids = kernel_with_cluster
    rank = next(p for p in pids if RANK_COMMAND in " ".join(_cmdline(p)))
    copying = f"{HEAL_SHARED_MEMORY}/{HEAL_FILE_PREFIX}{rank}-in-the-middle-of-a-copy"
    with open(copying, "wb") as f:
        f.write(b"state")
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    _assert_all_gone(pids)
    deadline = time.monotonic() + 10
    while os.path.exists(copying) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(copying), "the heal's file was left in shared memory"


def test_kernel_shutdown_leaves_nothing(kernel_with_cluster):
    km, _, pids = kernel_with_cluster
    km.shutdown_kernel(now=False)
    _assert_all_gone(pids)


def test_kernel_restart_leaves_nothing(kernel_with_cluster):
    km, _, pids = kernel_with_cluster
    km.restart_kernel(now=False)
    _assert_all_gone(pids)
