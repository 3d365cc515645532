"""The namespace test cluster the multi-host tests share: one per module (a login host and two
nodes), checked to be gone afterwards, and no process left on it after each test."""

from __future__ import annotations

import pytest
from netns_hosts import HostCluster, leftovers


@pytest.fixture(scope="module")
def host_cluster():
    with HostCluster(2, login=True) as c:
        yield c
    assert leftovers(c.tag) == []


@pytest.fixture
def hosts(host_cluster):
    yield host_cluster
    left = host_cluster.wait_no_processes(10)
    host_cluster.kill_processes()  # so that one test's leftovers do not fail the next
    assert left == {}, f"processes left on the test hosts 10 s after the session ended: {left}"
