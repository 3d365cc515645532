"""The signatures the pages write out, against the code: a page that shows ``NAME(a, b=1)`` for
a callable of ``ipydist.torch`` (``hvd.NAME``) lists every parameter it takes, in order, with
its default, unless the span says it leaves some out (``...``). And inside-cells.md, which the
README calls the list of every name, has every name.

(Issue 51 found ``DistributedOptimizer``'s ``distributed_after`` missing from two pages that
wrote its whole signature, and ``elastic`` missing from inside-cells.md.)
"""

from __future__ import annotations

import inspect
import re

import pytest
from test_docs import DOCS, PAGES, code_spans, documents, torch_all


def _split_top_level(text: str) -> list[str]:
    """``a, b=f(1, 2), c`` -> ``["a", "b=f(1, 2)", "c"]``."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def written_signatures(name: str) -> list[tuple[str, str]]:
    """``(page, the parameters as written)`` for each code span of a page that is a call of
    ``name`` with its parameters written out: ``NAME(...)`` or ``hvd.NAME(...)`` alone."""
    found = []
    for page, text in PAGES.items():
        for span in code_spans(text):
            m = re.fullmatch(rf"(?:hvd\.)?{re.escape(name)}\((.*)\)", span)
            if m:
                found.append((page, m.group(1)))
    return found


def _callables() -> list[str]:
    import ipydist.torch as hvd

    return [n for n in torch_all() if callable(getattr(hvd, n))
            and not inspect.isclass(getattr(hvd, n)) and written_signatures(n)]


_NOT_A_VALUE = object()


def _value(text: str, namespace: dict):
    """What a default as written means in ``hvd``'s namespace (``Average``,
    ``Compression.none``, ``25``); _NOT_A_VALUE where it names something else (a user's
    variable: the span is a call, not the signature)."""
    try:
        return eval(text, {"__builtins__": {}}, namespace)  # noqa: S307 - the docs' own text
    except Exception:
        return _NOT_A_VALUE


@pytest.mark.parametrize("name", _callables())
def test_a_signature_written_out_on_a_page_is_the_code_s(name):
    import ipydist.torch as hvd

    namespace = dict(vars(hvd))
    code = inspect.signature(getattr(hvd, name)).parameters
    required = [n for n, p in code.items() if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    defaulted = [n for n, p in code.items() if p.default is not p.empty]
    for page, written in written_signatures(name):
        parts = [p for p in _split_top_level(written) if not p.startswith("*")]  # **kwargs
        if not parts or "..." in parts or "_" in parts or any(
                p.endswith("=...") for p in parts):
            continue  # a call without arguments, or a list that says it leaves some out
        keywords = dict(tuple(s.strip() for s in p.split("=", 1)) for p in parts if "=" in p)
        values = {k: _value(v, namespace) for k, v in keywords.items()}
        if any(v is _NOT_A_VALUE for v in values.values()):
            continue  # ``save_checkpoint(path, model=model)``: a call with the user's values
        differ = [k for k, v in values.items() if k not in code or v != code[k].default]
        if differ and len(parts) < 3:
            continue  # ``DistributedOptimizer(op=Adasum)``: a call, showing one choice
        assert not differ, (
            f"docs/{page} writes {name}({written}): {differ} differ from the code's "
            f"parameters and defaults {dict((n, code[n].default) for n in defaulted)}")
        positional = [p for p in parts if "=" not in p]
        assert len(positional) == len(required) and list(keywords) == defaulted, (
            f"docs/{page} writes {name}({written}); the code takes {required} and then "
            f"{defaulted}: write every one, in order, or end the list with `...`")


@pytest.mark.parametrize("name", torch_all())
def test_inside_cells_has_every_name_of_ipydist_torch(name):
    page = (DOCS / "inside-cells.md").read_text()
    assert any(documents(span, name) for span in code_spans(page)), (
        f"hvd.{name} is not in docs/inside-cells.md, which the README calls the list of every "
        "name of ipydist.torch")
