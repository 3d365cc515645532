"""The README documents what the code does (issue 6, item 6): every magic's ``--help`` text
(its description and each option's help) appears in the README word for word, and every
``ipydist`` subcommand and option is listed there. Change one, and this says which to update.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ipydist import cli
from ipydist.magics import DistMagics

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
MAGICS = ["dist_start", "everyrank", "dist_mode", "dist_status", "dist_pull", "dist_push",
          "dist_stop", "dist_restart", "dist_timeline"]


def flat(text: str) -> str:
    """Whitespace collapsed, reST double backquotes as Markdown's single ones."""
    return re.sub(r"\s+", " ", text.replace("``", "`")).strip()


FLAT_README = flat(README.replace("\\|", "|"))


def description(magic: str) -> str:
    """The magic's own sentence from its ``--help`` (after the usage block, if any)."""
    doc = getattr(DistMagics, magic).__doc__
    paragraphs = [p for p in doc.split("\n\n") if p.strip()]
    return next(flat(p) for p in paragraphs
                if not p.strip().startswith(("::", "%", "options:", "positional arguments:")))


def option_helps(magic: str) -> list[tuple[str, str]]:
    """(option string, expanded help) for each documented argument of the magic."""
    parser = getattr(getattr(DistMagics, magic), "parser", None)
    if parser is None:
        return []
    formatter = parser._get_formatter()
    out = []
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        out.append((name, flat(formatter._expand_help(action))))
    return out


@pytest.mark.parametrize("magic", MAGICS)
def test_each_magic_is_in_the_readme_with_its_own_description(magic):
    name = "%%everyrank" if magic == "everyrank" else f"%{magic}"
    assert f"| `{name}" in README, f"{name} is missing from the README's table of magics"
    assert description(magic) in FLAT_README, (
        f"the README should describe {name} as its --help does: {description(magic)!r}")


@pytest.mark.parametrize("magic", [m for m in MAGICS if option_helps(m)])
def test_each_magic_option_has_its_help_text_in_the_readme(magic):
    for name, text in option_helps(magic):
        assert text in FLAT_README, f"%{magic} {name}: README should say {text!r}"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices, {c.dest: c.help for c in action._choices_actions}


def test_each_ipydist_command_and_option_is_in_the_readme():
    parsers, helps = subcommands()
    assert set(parsers) == {"run", "demo", "install-kernel", "uninstall-kernel", "doctor"}
    for command, parser in parsers.items():
        row = next((line for line in README.splitlines()
                    if line.startswith(f"| `ipydist {command}")), None)
        assert row is not None, f"ipydist {command} is missing from the README's command table"
        assert flat(helps[command]) in flat(row), f"ipydist {command}: {helps[command]!r}"
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert option in row, f"ipydist {command} {option} is not in the README"
