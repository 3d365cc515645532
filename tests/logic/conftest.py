"""The pure-logic tier (``make test-fast``): no ranks, no hosts, no browser. A test here that
asks for a cluster fixture belongs in tests/cluster; collection says so instead of letting the
inner loop slow down."""

from __future__ import annotations

import pytest

#: The fixtures that start ranks or load the machine (tests/conftest.py); an IPython shell
#: with ipydist loaded (``shell``, ``magics``) starts nothing.
CLUSTER_FIXTURES = {"cluster", "no_cluster", "transport", "hogs"}


def pytest_collection_modifyitems(items):
    for item in items:
        used = CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))
        if used and "tests/logic/" in str(item.path).replace("\\", "/"):
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(used)}: cluster tests go in tests/cluster")


@pytest.fixture
def idle_shell(shell, magics, monkeypatch):
    """The shared shell as if no cluster were running, for a test of what a magic says then.
    With several workers a cluster test file may run first in the same worker and leave the
    shared cluster in this shell (tests/conftest.py); it is set aside, not stopped, and given
    back after the test."""
    monkeypatch.setattr(magics, "session", None)
    return shell
