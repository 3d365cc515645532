"""Pure logic of a magic in a cell tagged ``raises-exception``: the error is shown and the
cell's reply is ok, so that JupyterLab's Run All goes on (the browser test runs the failure
notebook that way). The kernel here is a stand-in that holds the request's metadata."""

from __future__ import annotations

import pytest

from ipydist.errors import CellTimeout
from ipydist.notebook import expected_errors


class _Kernel:
    def __init__(self, metadata):
        self.metadata = metadata

    def get_parent(self, channel="shell"):
        return {"header": {}, "metadata": self.metadata, "content": {}}


@pytest.fixture
def kernel_shell(idle_shell, monkeypatch):
    """The test shell (ipydist loaded), with no cluster (``idle_shell``) and no kernel until a
    test gives it one."""
    shell = idle_shell
    monkeypatch.setattr(shell, "kernel", None, raising=False)
    return shell


def _failing():
    raise CellTimeout("the cell ran past --timeout 3 s; interrupted ranks 0-3.")


@pytest.mark.parametrize("metadata, tags", [
    ({"tags": ["raises-exception", "x"]}, ["raises-exception", "x"]),
    ({"tags": "raises-exception"}, []),  # not a list: no tags
    ({}, []),
    (None, []),
])
def test_the_running_cell_s_tags_come_from_the_request(kernel_shell, metadata, tags):
    kernel_shell.kernel = _Kernel(metadata)
    assert expected_errors.running_cell_tags() == tags


def test_outside_a_kernel_there_are_no_tags(kernel_shell):
    assert expected_errors.running_cell_tags() == []


def test_a_tagged_cell_shows_the_error_and_returns(kernel_shell, capsys):
    kernel_shell.kernel = _Kernel({"tags": ["raises-exception"]})
    assert expected_errors.shown_when_expected(_failing)() is None
    out, err = capsys.readouterr()
    assert "CellTimeout: the cell ran past --timeout 3 s" in out + err


def test_an_untagged_cell_raises(kernel_shell):
    kernel_shell.kernel = _Kernel({"tags": ["other"]})
    with pytest.raises(CellTimeout):
        expected_errors.shown_when_expected(_failing)()


def test_an_interrupt_is_never_expected(kernel_shell):
    kernel_shell.kernel = _Kernel({"tags": ["raises-exception"]})

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        expected_errors.shown_when_expected(interrupted)()


def test_ipydist_s_magics_in_a_tagged_cell_let_the_run_go_on(kernel_shell, capsys):
    # no cluster is running: %%everyrank fails with a UsageError, shown, and the cell is ok
    kernel_shell.kernel = _Kernel({"tags": ["raises-exception"]})
    result = kernel_shell.run_cell("%%everyrank\nx = 1")
    out, err = capsys.readouterr()
    assert result.error_in_exec is None and "no cluster is running" in out + err
    kernel_shell.kernel = _Kernel({})
    result = kernel_shell.run_cell("%%everyrank\nx = 1")
    assert "no cluster is running" in str(result.error_in_exec)
