"""Every magic's ``--help`` prints its options and does nothing else, and the magics translate
ipydist's errors in one place: a one-line ``UsageError``, unless the error shows itself.
Every error class ipydist defines is an ``IpydistError`` (an interrupt excepted)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from IPython.core.error import UsageError

import ipydist
from ipydist.errors import CellInterrupted, CellTimeout, RankDied, shows_itself
from ipydist.magics import DistMagics

PACKAGE = Path(ipydist.__file__).parent
MAGICS = sorted(n for kind in DistMagics.magics.values() for n in kind)


@pytest.mark.parametrize("name", MAGICS)
@pytest.mark.parametrize("ask", ["--help", "-h"])
def test_every_magic_prints_its_options_on_help(idle_shell, capsys, name, ask):
    result = idle_shell.run_line_magic(name, ask)
    out, err = capsys.readouterr()
    assert result is None and err == ""
    method = getattr(DistMagics, name)
    parser = getattr(method, "parser", None)
    if parser is None:  # a magic without options: its docstring
        assert method.__doc__.split()[0] in out
        return
    assert f"%{name}" in out and "-h, --help" in out
    for action in parser._actions:
        shown = [o for o in action.option_strings if action.help != "==SUPPRESS=="]
        assert all(o in out for o in shown), (name, shown)


def test_help_of_a_cell_magic_runs_no_cell(idle_shell, capsys):
    # no cluster runs: were the cell sent, the magic would say so
    result = idle_shell.run_cell("%%everyrank --help\nx = 1\n")
    out, _ = capsys.readouterr()
    assert result.error_in_exec is None and "--ranks SPEC" in out


def test_help_among_other_options_still_only_helps(idle_shell, magics, capsys):
    result = idle_shell.run_cell("%dist_start --np 2 --help")
    out, _ = capsys.readouterr()
    assert result.error_in_exec is None and "--gpus-per-rank" in out
    assert magics.session is None  # nothing started


@pytest.mark.parametrize("line, words", [
    ("%dist_start --np x", "--np x: the number of ranks must be a whole number"),
    ("%dist_start --backend tpu", "--backend tpu"),
    ("%dist_pull x", "no cluster is running"),
    ("%dist_stack", "no cluster is running"),
    ("%dist_status", "no cluster is running"),
    ("%dist_push not_a_variable_here", "no cluster is running"),
])
def test_ipydist_s_errors_are_one_line_usage_errors(idle_shell, line, words):
    result = idle_shell.run_cell(line)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert words in str(result.error_in_exec)


def test_errors_that_show_themselves_are_left_to_do_so():
    assert shows_itself(RankDied("rank 1 died")) and shows_itself(CellTimeout("late"))
    assert not shows_itself(ipydist.errors.ClusterError("x"))


def _error_classes() -> list[tuple[str, str]]:
    """(module, class) of every class in ipydist's source whose bases name an error."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b).endswith(("Error", "Exception", "Interrupt", "Timeout"))
                    for b in node.bases):
                found.append((module.removesuffix(".__init__"), node.name))
    return found


#: Raised and caught inside ipydist, never shown: control flow, not errors.
SIGNALS = {"_HelpShown", "Deferred"}


@pytest.mark.parametrize("module, name", _error_classes())
def test_every_error_ipydist_defines_is_an_ipydist_error(module, name):
    cls = getattr(importlib.import_module(module), name)
    if name in SIGNALS:
        return
    if cls is CellInterrupted:  # an interrupt is not an error: except Exception must miss it
        assert issubclass(cls, KeyboardInterrupt) and not issubclass(cls, Exception)
        return
    assert issubclass(cls, ipydist.IpydistError), f"{module}.{name}"
