"""Safe by default (issue 5, item 6): on one host the cluster listens on loopback only, its
connection files are private, and its messages are signed.

Two listeners are outside ipydist's control and are checked as the known exceptions: torch's
TCPStore on rank 0 (the process-group rendezvous; torch binds it to every interface) and
mpiexec's own daemon port (PRRTE refuses to run its out-of-band channel on loopback alone).
"""

from __future__ import annotations

import glob
import json
import os
import stat

import psutil
from helpers import run_cell

LOOPBACK = ("127.0.0.1", "::1")


def listeners(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_controller_and_ranks_listen_on_loopback_only(shell, capsys, cluster):
    controller = cluster.cluster.controller_pid
    assert listeners(controller), "the controller listens somewhere"
    assert {ip for ip, _ in listeners(controller)} <= set(LOOPBACK), listeners(controller)
    run_cell(shell, capsys, "%everyrank import os; store_port = int(os.environ['MASTER_PORT'])")
    store_port = cluster.pull("store_port", rank=0)
    for info in cluster.ranks:
        public = {(ip, port) for ip, port in listeners(info["pid"]) if ip not in LOOPBACK}
        if info["rank"] == 0:
            public = {(ip, port) for ip, port in public if port != store_port}
        assert public == set(), f"rank {info['rank']} listens on {public}"


def test_connection_files_are_private_and_messages_signed(cluster):
    security = os.path.join(cluster.cluster.profile_dir, "security")
    # (the cluster-*.json state file next to them holds pids, no key; the folder is 0700)
    files = glob.glob(os.path.join(security, "ipcontroller-*.json"))
    assert files, "no connection files"
    assert stat.S_IMODE(os.stat(cluster.cluster.profile_dir).st_mode) == 0o700
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        info = json.load(open(path))
        assert len(info["key"]) >= 32 and info["signature_scheme"].startswith("hmac-"), path
        assert info["interface"].endswith("127.0.0.1"), info
