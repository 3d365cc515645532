"""Shaped links between the namespace test hosts (tests/harness/shaped_links.py): every host's
eth0 sends at most the link's rate (and, where the kernel has netem, its delay later), and
nothing of the shaping is left once the hosts are gone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from netns_hosts import HostCluster, leftovers, unavailable
from shaped_links import Link, qdisc

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

LINK = Link("200mbit", delay="0.2ms")
MEGABYTES = 40
#: node2 counts what arrives, then says how many bytes.
SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 5001))
print("ready", flush=True)
conn, _ = server.accept()
got = 0
while chunk := conn.recv(1 << 20):
    got += len(chunk)
print(got, flush=True)
"""
#: node1 sends MEGABYTES and waits for node2 to have read them all (its close).
CLIENT = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 5001))
block = bytes(1 << 20)
t0 = time.perf_counter()
for _ in range(int(sys.argv[2])):
    conn.sendall(block)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(time.perf_counter() - t0)
"""


def test_a_shaped_link_holds_its_rate_and_leaves_nothing():
    with HostCluster(2, login=False, link=LINK) as cluster:
        tag = cluster.tag
        for h in cluster.hosts:
            shown = qdisc(h.netns)
            assert cluster.shaped_with in shown and "200Mbit" in shown, shown
        node2 = cluster.host("node2")
        server = cluster.popen("node2", [sys.executable, "-c", SERVER, node2.address],
                               stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            sent = cluster.run("node1", [sys.executable, "-c", CLIENT, node2.address,
                                         str(MEGABYTES)], capture_output=True, timeout=120,
                               text=True, check=True)
            seconds = float(sent.stdout.strip())
            assert int(server.stdout.readline()) == MEGABYTES << 20
        finally:
            server.kill()
            server.wait()
        rate = MEGABYTES * 8 * 2**20 / seconds
        # never faster than the link (unshaped, a veth pair carries several Gbit/s here)
        assert rate <= 1.15 * LINK.bits_per_second, f"{rate / 1e6:.0f} Mbit/s"
        print(f"\nipydist-measure: shaped link {LINK.rate} ({cluster.shaped_with}): "
              f"{rate / 1e6:.0f} Mbit/s")
        if cluster.shaped_with == "netem":  # a round trip crosses two delays
            ping = cluster.run("node1", ["ping", "-c", "5", "-i", "0.2", node2.address],
                               capture_output=True, text=True, timeout=30)
            fastest = float(ping.stdout.split("=")[-1].split("/")[0])
            assert fastest >= 0.4, ping.stdout
    time.sleep(0.1)
    assert leftovers(tag) == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in namespaces, namespaces


def test_a_link_speaks_tcs_units():
    assert Link("1gbit").bits_per_second == 1e9
    assert Link("200mbit").bits_per_second == 2e8
    with pytest.raises(ValueError, match="expected e.g. 1gbit"):
        Link("fast").bits_per_second  # noqa: B018
