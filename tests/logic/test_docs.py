"""The docs say what the code does (issue 6, item 6; issue 28, item 3). Change one, and a test
here says which page to update:

- every magic is in the README's table with its own ``--help`` sentence, and on
  ``docs/magics.md`` with each option's ``--help`` text word for word;
- every ``ipydist`` subcommand and option is in the README's command table;
- every name of ``ipydist.torch.__all__`` is documented on a page of ``docs/`` and has its entry
  in the API reference (``docs/api.md``);
- every module of ``src/ipydist`` is on ``docs/architecture.md``, and every module that page
  names exists;
- the README stays short (the rest is in ``docs/``), and every relative link of the README and
  of ``docs/`` leads to a file that exists (and, for a Markdown file, to a heading on it).

Pure logic: nothing here starts ranks or imports torch. ``ipydist.torch``'s names and the module
tree are read from this checkout's ``src/``, next to the docs they are held against.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import unicodedata
from pathlib import Path

import pytest

from ipydist import cli
from ipydist.magics import DistMagics
from ipydist.session import Session
from ipydist.specs import StartOptions, default_of, flag_of


def repo_root() -> Path:
    """The checkout this file is in (the folder with pyproject.toml), wherever tests/ puts it."""
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").is_file())


ROOT = repo_root()
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "ipydist"
README = (ROOT / "README.md").read_text()
MAGICS_PAGE = (DOCS / "magics.md").read_text()
ARCHITECTURE = (DOCS / "architecture.md").read_text()
API_PAGE = (DOCS / "api.md").read_text()
#: The pages written by hand: the API reference is generated from the docstrings, so a name
#: counts as documented only where a page says something of it.
PAGES = {p.name: p.read_text() for p in sorted(DOCS.glob("*.md")) if p.name != "api.md"}
MAGICS = ["dist_start", "everyrank", "dist_mode", "dist_status", "dist_pull", "dist_push",
          "dist_stop", "dist_restart", "dist_timeline", "dist_scale", "dist_debug",
          "dist_stack"]
README_MAX_LINES = 300


def flat(text: str) -> str:
    """Whitespace collapsed, reST double backquotes as Markdown's single ones."""
    return re.sub(r"\s+", " ", text.replace("``", "`")).strip()


def flat_markdown(text: str) -> str:
    """A Markdown page flattened, with table cells' escaped bars as plain ones."""
    return flat(text.replace("\\|", "|"))


def without_fences(markdown: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.MULTILINE | re.DOTALL)


FLAT_README = flat_markdown(README)
FLAT_MAGICS_PAGE = flat_markdown(MAGICS_PAGE)


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
        if action.help in (None, argparse.SUPPRESS) or "--help" in action.option_strings:
            continue  # every magic's --help is said once, above the tables
        name = action.option_strings[0] if action.option_strings else action.dest
        out.append((name, flat(formatter._expand_help(action))))
    return out


# --- magics and the ipydist command ----------------------------------------------------------


def test_every_magic_of_the_extension_is_in_the_list_these_tests_check():
    registered = {name for kind in DistMagics.magics.values() for name in kind}
    assert registered == set(MAGICS), (
        f"magics not in test_docs.MAGICS (and so maybe not documented): "
        f"{sorted(registered - set(MAGICS))}; listed but gone: {sorted(set(MAGICS) - registered)}")


#: Where each magic is described with its own --help sentence: (page, how its entry starts,
#: the page, the page flattened). The README has the one-line table; docs/magics.md the entries.
MAGIC_PAGES = {"README.md": ("| `", README, FLAT_README),
               "docs/magics.md": ("`", MAGICS_PAGE, FLAT_MAGICS_PAGE)}


@pytest.mark.parametrize("page", MAGIC_PAGES)
@pytest.mark.parametrize("magic", MAGICS)
def test_each_magic_is_described_as_its_help_does(magic, page):
    name = "%%everyrank" if magic == "everyrank" else f"%{magic}"
    entry, text, flat_text = MAGIC_PAGES[page]
    assert f"{entry}{name}" in text, f"{name} is missing from {page}"
    assert description(magic) in flat_text, (
        f"{page} should describe {name} as its --help does: {description(magic)!r}")


@pytest.mark.parametrize("magic", [m for m in MAGICS if option_helps(m)])
def test_each_magic_option_has_its_help_text_on_the_magics_page(magic):
    for name, text in option_helps(magic):
        assert text in FLAT_MAGICS_PAGE, f"%{magic} {name}: docs/magics.md should say {text!r}"


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


# --- Session's options and methods -------------------------------------------------------------

SESSION_PAGE = (DOCS / "session.md").read_text()


def session_option_row(option: dataclasses.Field) -> str:
    """The row of docs/session.md's table that ``option`` (a StartOptions field) makes."""
    default = default_of(option)
    flag = flag_of(option)
    spelled = "(Python only)" if flag is None else f"`{flag}`" + (
        f" / `{option.metadata['off']}`" if option.metadata["off"] else "")
    meaning = option.metadata["help"].replace("|", "\\|")
    if default is True:  # a --no-... switch: its help says what turning it off does
        meaning = f"`False` (`{flag}`): {meaning}"
    return f"| `{option.name}` | {spelled} | `{default!r}` | {meaning} |"


@pytest.mark.parametrize("option", dataclasses.fields(StartOptions), ids=lambda o: o.name)
def test_each_start_option_is_in_the_session_page_as_declared(option):
    assert session_option_row(option) in SESSION_PAGE.splitlines(), (
        f"docs/session.md should have the row\n{session_option_row(option)}")


def test_the_session_page_lists_no_option_that_is_not_declared():
    rows = [line.split("|")[1].strip(" `") for line in SESSION_PAGE.splitlines()
            if line.startswith("| `") and "| `--" in line or "(Python only)" in line]
    assert sorted(rows) == sorted(o.name for o in dataclasses.fields(StartOptions))


def test_session_takes_every_start_option_by_keyword_with_its_default():
    parameters = inspect.signature(Session).parameters
    for option in dataclasses.fields(StartOptions):
        assert parameters[option.name].default == default_of(option), option.name
    assert list(parameters)[1:] == [o.name for o in dataclasses.fields(StartOptions)]


def test_the_start_magic_has_one_argument_per_option_with_the_declared_help():
    parser = DistMagics.dist_start.parser
    by_dest = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    for option in dataclasses.fields(StartOptions):
        flag = flag_of(option)
        if flag is None:
            assert option.name not in by_dest
            continue
        actions = by_dest[option.name]
        assert flag in actions[0].option_strings, (option.name, actions[0].option_strings)
        assert flat(actions[0].help.replace("%%", "%")) == flat(option.metadata["help"])


@pytest.mark.parametrize("method", sorted(
    name for name, value in vars(Session).items()
    if not name.startswith("_") and callable(value) and name not in ("death_report",
    "start_heal", "healed")))
def test_each_public_method_of_session_is_in_the_session_page(method):
    assert f"| `{method}(" in SESSION_PAGE, f"docs/session.md lacks a row for {method}()"


# --- ipydist.torch's names --------------------------------------------------------------------


def torch_all() -> list[str]:
    """``ipydist.torch.__all__``, read from the source (importing it would import torch)."""
    tree = ast.parse((PACKAGE / "torch" / "__init__.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets)):
            return list(ast.literal_eval(node.value))
    raise AssertionError("ipydist/torch/__init__.py has no __all__")


def code_spans(markdown: str) -> list[str]:
    """The text of every inline code span of a Markdown page (code blocks are examples, and
    do not count)."""
    spans = re.findall(r"(`+)(.+?)\1", without_fences(markdown), flags=re.DOTALL)
    return [re.sub(r"\s+", " ", text).strip() for _, text in spans]


def documents(span: str, name: str) -> bool:
    """Whether a code span documents ``name``: it is ``NAME`` or ``hvd.NAME``, alone or
    followed by what is not part of a name (``NAME(...)``, ``NAME.fp16``, ``NAME, ...``).
    ``allreduce_async_`` documents ``allreduce_async_`` only, not ``allreduce_async``."""
    return re.match(rf"(?:hvd\.)?{re.escape(name)}(?!\w)", span) is not None


@pytest.mark.parametrize("name", torch_all())
def test_each_name_of_ipydist_torch_is_documented_on_a_page(name):
    pages = [page for page, text in PAGES.items()
             if any(documents(span, name) for span in code_spans(text))]
    assert pages, (
        f"hvd.{name} is in ipydist.torch.__all__ but no page of docs/ (api.md aside) says what "
        f"it does: add it, as `{name}` or `hvd.{name}`, where it belongs (inside-cells.md lists "
        f"every name)")


@pytest.mark.parametrize("name", torch_all())
def test_each_name_of_ipydist_torch_is_in_the_api_reference(name):
    assert re.search(rf"^::: ipydist\.torch\.{re.escape(name)}\s*$", API_PAGE, re.MULTILINE), (
        f"docs/api.md has no `::: ipydist.torch.{name}` entry")


def test_the_api_reference_names_only_what_ipydist_torch_exports():
    listed = re.findall(r"^::: ipydist\.torch\.(\w+)\s*$", API_PAGE, re.MULTILINE)
    assert sorted(set(listed) - set(torch_all())) == [], "docs/api.md lists names gone from __all__"
    assert len(listed) == len(set(listed)), "docs/api.md lists a name twice"


# --- modules and the architecture page ---------------------------------------------------------


def module_paths(package: Path) -> list[str]:
    """Every module of the package, as the architecture page writes it: its path relative to
    ``src/`` (``ipydist/torch/_core/topology.py``). A package's ``__init__.py`` counts as named
    when the page names the file or the package's folder (``ipydist/torch/_core/``)."""
    return sorted(str(p.relative_to(package.parent)) for p in package.rglob("*.py")
                  if "__pycache__" not in p.parts)


def named_paths(page: str) -> set[str]:
    """Every ``ipydist/...`` path the page writes in backquotes."""
    return {span for span in code_spans(page) if re.fullmatch(r"ipydist(/[\w.]+)*/?", span)}


def missing_from(page: str, modules: list[str]) -> list[str]:
    named = named_paths(page)
    return [m for m in modules
            if m not in named
            and not (m.endswith("/__init__.py") and m.removesuffix("__init__.py") in named)]


def test_every_module_is_on_the_architecture_page():
    missing = missing_from(ARCHITECTURE, module_paths(PACKAGE))
    assert missing == [], (
        f"docs/architecture.md does not name {missing}: add a line for each (its path relative "
        f"to src/ in backquotes, the process it runs in, what it does)")


def test_every_module_the_architecture_page_names_exists():
    src = PACKAGE.parent
    gone = sorted(p for p in named_paths(ARCHITECTURE)
                  if not (src / p).exists() or (p.endswith(".py") and not (src / p).is_file()))
    assert gone == [], f"docs/architecture.md names modules that do not exist: {gone}"


# --- the README's length and every link -------------------------------------------------------


def test_the_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to a page of "
        f"docs/ and link to it")


def without_code(markdown: str) -> str:
    """The page without code blocks and code spans, where ``[x](y)`` is no link."""
    return re.sub(r"(`+).+?\1", "", without_fences(markdown), flags=re.DOTALL)


def links(markdown: str) -> list[str]:
    """Targets of the page's inline links and images: ``[text](target)``, ``![alt](target)``."""
    return re.findall(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)",
                      without_code(markdown))


def slug(heading: str) -> str:
    """A heading's anchor as Python-Markdown's toc extension makes it (MkDocs' default)."""
    text = re.sub(r"`|\*\*|\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown: str) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", without_fences(markdown), re.MULTILINE)
    return {slug(h) for h in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    return broken


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_that_exists(page):
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken links"
