"""A measured figure exists once: on the benchmarks page, which the other pages quote.

A figure that two pages give on their own drifts: one page is updated after a new run, the
other keeps the old value, and a reader meets "1.8x" here and "1.9x" there, or "17-20 ms" and
"12.9 ms" for one measurement. So every figure a user page quotes — a ratio (``0.85x``,
``1.2-2.0x``) or a time or a rate with a decimal point (``12.9 ms``, ``0.16-0.21 s``,
``1862 MB/s``) — must be written, as the page writes it, in ``docs/benchmarks.md``, where the
benchmark scripts' results are kept with how they were measured. When a new run changes a figure
there, each page that quotes the old value fails here, named with its line, until it quotes the
new one.

A figure that is a setting, not a measurement (a threshold the code applies, a bar a test
holds), is named in :data:`SETTINGS` with what it is. Whole numbers of seconds (``60 s``,
``2 s``) are timeouts and intervals, not measurements, and are not read. Fenced code blocks are
left out (their numbers are what a command prints or takes).

Pure logic: nothing here starts ranks or imports torch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def repo_root() -> Path:
    """The checkout this file is in (the folder with pyproject.toml), wherever tests/ puts it."""
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").is_file())


ROOT = repo_root()
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
#: Pages that quote figures: every user page but the benchmarks page itself, and the
#: developers' page and the changelog, which tell how figures got to where they are.
QUOTING_PAGES = [ROOT / "README.md", *sorted(
    p for p in (ROOT / "docs").glob("*.md")
    if p.name not in ("benchmarks.md", "developing.md", "changelog.md"))]

_NUMBER = r"\d+(?:\.\d+)?"
_RANGE = rf"{_NUMBER}(?:\s?[-–]\s?{_NUMBER})?"
#: A ratio: ``0.85x``, ``2-20x``, ``0.93–1.14x``; not a hex digit or a name (``0x1f``, ``4x4``).
RATIO = re.compile(rf"(?<![\w.])({_RANGE}x)(?![\w])")
#: A time or a rate with a decimal point somewhere in it: ``12.9 ms``, ``0.5-1 s``,
#: ``1862 MB/s`` (rates with or without one).
TIME = re.compile(
    rf"(?<![\w.])((?:\d+\.\d+(?:\s?[-–]\s?{_NUMBER})?|\d+\s?[-–]\s?\d+\.\d+)\s?(?:ms|us|µs|s)"
    rf"|{_RANGE}\s?[MG]B/s)(?![\w/])")

#: Figures that are settings or bars, by page: the figure and what it is.
SETTINGS: dict[str, dict[str, str]] = {
    "live-metrics.md": {
        "1.2x": "the threshold above which the chart calls a rank a straggler "
                "(STRAGGLER_RATIO, ipydist.notebook.live.summary)",
    },
    "magics.md": {
        "0.25 s": "how long a line waits for the other ranks' copies on an idle machine "
                  "(HOLD_SECONDS, ipydist.notebook.output.lines)",
    },
    "slow-networks.md": {
        "20x": "the bar benchmarks/onebit_accuracy.py holds on the bytes saved",
    },
}


def _normal(figure: str) -> str:
    """One spelling of a figure: en dashes as hyphens, no spaces."""
    return re.sub(r"\s", "", figure.replace("–", "-"))


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, with their numbers."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def figures_in(text: str) -> list[str]:
    return [m.group(1) for pattern in (RATIO, TIME) for m in pattern.finditer(text)]


def measured() -> set[str]:
    """Every figure the benchmarks page writes (its code blocks too: a printed table)."""
    return {_normal(f) for f in figures_in(BENCHMARKS.read_text())}


@pytest.mark.parametrize("page", QUOTING_PAGES, ids=lambda p: p.name)
def test_each_figure_a_page_quotes_is_the_benchmarks_pages(page):
    known = measured()
    settings = SETTINGS.get(page.name, {})
    strays = [f"{page.relative_to(ROOT)}:{number}: {figure}"
              for number, line in prose_lines(page)
              for figure in figures_in(line)
              if figure not in settings and _normal(figure) not in known]
    assert not strays, (
        "figures quoted here but not written in docs/benchmarks.md (a figure exists once: "
        "quote the benchmarks page's value, add the measurement there, or, for a setting, "
        "name it in SETTINGS):\n" + "\n".join(strays))


def test_the_patterns_find_figures_and_leave_other_numbers():
    text = ("0.85x at 1 MB, 0.93–1.14x, 2-20x faster; 12.9 ms against 32.6 ms; 0.16-0.21 s; "
            "1862 MB/s; a 60 s timeout; 0x1f; a 4x4 grid; torch 2.13.0; 1.5 GB")
    assert figures_in(text) == ["0.85x", "0.93–1.14x", "2-20x", "12.9 ms", "32.6 ms",
                                "0.16-0.21 s", "1862 MB/s"]


def test_a_setting_named_is_on_its_page():
    """An entry of SETTINGS that its page no longer writes is stale: remove it."""
    for name, figures in SETTINGS.items():
        written = {f for _, line in prose_lines(ROOT / "docs" / name) for f in figures_in(line)}
        assert set(figures) <= written, f"{name} no longer writes {set(figures) - written}"
