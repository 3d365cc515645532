"""User pages say what is true now; history goes to ``docs/developing.md``.

A reader of the README or of a page of ``docs/`` wants to know what ipydist does, not what it
did before some change: "it was 21 us before ...", "no longer waits", "until issue 46",
"(before November 2026's default)" or "renamed from" tell how the code got here, and mean
little to a reader who never knew the code before. That story, with its figures, belongs on
the developers' page, ``docs/developing.md`` ("How the figures got here"), which this test does
not read, or in a changelog.

The test reads ``README.md`` and every ``docs/*.md`` but ``developing.md`` and ``changelog.md``
(what changed, release by release), leaving out fenced code blocks, and fails on a phrase of
:data:`HISTORY`, naming the page, the line and the phrase.
A phrase broken across two lines is found too. A link to another project's issue (JupyterLab's
issue 2833) is not history of ipydist's: an issue number is allowed on a line that links to
that issue of another project on GitHub.

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
#: The pages users read. developing.md (the developers' page) and changelog.md are where
#: history goes.
USER_PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                          if p.name not in ("developing.md", "changelog.md"))]

_MONTH = (r"(?:January|February|March|April|May|June|July|August|September|October|November"
          r"|December)")

#: Phrases that narrate what the code was or did, rather than what it does. Matched without
#: regard to case; ``\s+`` lets a phrase run across a line break.
HISTORY = [
    r"\bissues?\s+#?\d+",                 # "issue 46", "since issue 49", "issue 36's bar"
    r"\bbefore\s+this\s+change\b",
    r"\bno\s+longer\b",
    r"(?<!\bis\s)(?<!\bare\s)(?<!\bbe\s)\bused\s+to\b",  # "used to abort", not "is used to"
    r"\bas\s+before\b",
    # A figure as it was ("it was 21 us before ..."). Plain "it was" also says where a thing
    # stands now ("the rank is left as it was", "where it was cut"), so only a figure counts.
    r"\bit\s+was\s+\d",
    r"\b(?:was|were)\s+renamed\b",
    r"\brenamed\s+from\b",
    r"\buntil\s+issue\b",
    r"\bsince\s+issue\b",
    r"\bthe\s+first\s+cut\b",
    r"\bnot[*_\s]+met[*_\s]+yet\b",       # also "**not met** yet"
    # "(before November 2026's default)", "Since 29 November every test ..."
    rf"\b(?:before|until|since)\s+(?:\d{{1,2}}\s+)?{_MONTH}\b",
    r"\bbefore\s+(?:\w+\s+){0,3}(?:was|were)\s+(?:fixed|mended|removed|renamed)\b",
    r"\bfirst\s+measurements\s+found\b",
    r"IPYDIST_UPDATE_SCREENSHOT",         # how a developer refreshes a picture: developing.md
]

#: Where a phrase of HISTORY says what is true now: (page, the words around it, why). Keep it
#: short; each entry allows that one phrase only, where those exact words are.
ALLOWED = [
    ("docs/failures.md", "so the ranks can no longer be reached",
     "ipydist's own error message, quoted as it prints it (notebook/cell.py)"),
]

#: A link to an issue or pull request of a project on GitHub: (owner, repository, number).
GITHUB_ISSUE_LINK = re.compile(r"github\.com/([\w.-]+)/([\w.-]+)/(?:issues|pull)/(\d+)")
THIS_PROJECT = "ipydist"

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.MULTILINE | re.DOTALL)


def without_fences(markdown: str) -> str:
    """The page with its fenced code blocks blanked out, every line kept where it was."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), markdown)


def links_to_another_projects_issue(lines: str, number: str) -> bool:
    """Whether these lines link to issue (or pull request) ``number`` of a project on GitHub
    that is not this one: "JupyterLab's [issue 2833](https://github.com/jupyterlab/...)"."""
    return any(repo.lower() != THIS_PROJECT and issue == number
               for _, repo, issue in GITHUB_ISSUE_LINK.findall(lines))


def allowed(page: str, text: str, match: re.Match) -> bool:
    for allowed_page, words, _why in ALLOWED:
        if allowed_page != page:
            continue
        for place in re.finditer(r"\s+".join(map(re.escape, words.split())), text):
            if place.start() <= match.start() and match.end() <= place.end():
                return True
    number = re.search(r"\d+", match.group(0))
    if number and re.match(r"issue", match.group(0), re.IGNORECASE):
        first = text.rfind("\n", 0, match.start()) + 1
        last = text.find("\n", match.end())
        return links_to_another_projects_issue(text[first:last if last >= 0 else None],
                                               number.group(0))
    return False


def history_in(page: Path) -> list[str]:
    """``page:line: "phrase" in: the line`` for each phrase of HISTORY on the page, in order."""
    name = str(page.relative_to(ROOT))
    text = without_fences(page.read_text())
    lines = text.splitlines()
    found = []
    for pattern in HISTORY:
        for match in re.finditer(pattern, text, re.IGNORECASE):
            if not allowed(name, text, match):
                line = text.count("\n", 0, match.start()) + 1
                phrase = " ".join(match.group(0).split())
                found.append((line, f'{name}:{line}: "{phrase}" in: {lines[line - 1].strip()}'))
    return [where for _, where in sorted(found)]


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_say_what_is_true_now_not_what_was(page):
    found = history_in(page)
    assert found == [], (
        "these lines narrate what the code was or did before; say what it does now, and move "
        "the history (figures included) to docs/developing.md, 'How the figures got here':\n"
        + "\n".join(found))


def test_the_phrases_are_found_and_another_projects_issue_is_not():
    for history in ("It was 2x slower before issue 12.", "it no\n  longer waits",
                    "(before November 2026's default)", "the targets are **not met** yet",
                    "`IPYDIST_UPDATE_SCREENSHOT=1`"):
        text = without_fences(history)
        assert any(re.search(p, text, re.IGNORECASE) for p in HISTORY), history
    for text, is_history in (("this used to be", True), ("the file is used to start", False)):
        assert any(re.search(p, text, re.IGNORECASE) for p in HISTORY) == is_history, text
    other = "JupyterLab's\n[issue 2833](https://github.com/jupyterlab/jupyterlab/issues/2833))."
    match = re.search(HISTORY[0], other, re.IGNORECASE)
    assert allowed("docs/x.md", other, match)
    ours = "[issue 12](https://github.com/someone/ipydist/issues/12)"
    assert not allowed("docs/x.md", ours, re.search(HISTORY[0], ours, re.IGNORECASE))
    fenced = "```\nno longer\n```\n"
    assert not any(re.search(p, without_fences(fenced), re.IGNORECASE) for p in HISTORY)
