"""Safe by default (issue 5, item 6; issue 14, item 2): on one host the cluster listens on
loopback only, its rendezvous needs no port, its connection files are private, and its
messages are signed.

One listener is outside ipydist's control and is checked as the known exception: mpiexec's
own daemon port (PRRTE refuses to run its out-of-band channel on loopback alone).
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
    for info in cluster.ranks:
        public = {(ip, port) for ip, port in listeners(info["pid"]) if ip not in LOOPBACK}
        assert public == set(), f"rank {info['rank']} listens on {public}"


def test_the_rendezvous_store_is_a_private_file_not_a_port(shell, capsys, cluster):
    result, _, err = run_cell(shell, capsys, """%%everyrank
import os, stat
from ipydist.torch._core import topology
_rt = topology.get()
store_kind = type(_rt.base_store).__name__
store_mode = stat.S_IMODE(os.stat(os.path.dirname(_rt.store_path)).st_mode)
""")
    assert result.error_in_exec is None, err
    assert cluster.pull("store_kind") == ["FileStore"] * cluster.size
    assert cluster.pull("store_mode") == [0o700] * cluster.size, "only this user can enter"


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
