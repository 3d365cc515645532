"""A griffe extension for the API reference (mkdocs.yml). Docstrings here are written with
reST's roles (:func:`allreduce`, :class:`~ipydist.specs.SpecError`) and literal blocks (a
paragraph ending ``::``, or ``::`` alone, then an indented block), which Markdown would show as
typed. Each role becomes a code span (the last dotted part only after a ``~``, as Sphinx shows
it), and each literal block a fenced code block after its paragraph, which keeps one colon."""

from __future__ import annotations

import re
import textwrap

import griffe

ROLE = re.compile(r":(?:func|meth|class|mod|attr|data|obj|exc|const|envvar):`(~?)([^`]+)`")
#: The headings argparse writes in a magic's docstring (IPython's ``magic_arguments``), each
#: before an indented block of options, fenced the same way.
ARGPARSE_HEADS = ("options:", "optional arguments:", "positional arguments:")


def literal_blocks(text: str) -> str:
    """reST's ``::`` literal blocks, and argparse's option lists, as fenced code blocks."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        opens = line.rstrip().endswith("::") or line.strip() in ARGPARSE_HEADS
        if opens and j < len(lines) and lines[j][:1] in (" ", "\t"):
            block = []
            while j < len(lines) and (not lines[j].strip() or lines[j][:1] in (" ", "\t")):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            lead = line.rstrip().removesuffix(":").removesuffix(":").rstrip()
            if lead:
                out += [lead + ":", ""]
            out += ["```", *textwrap.dedent("\n".join(block)).split("\n"), "```", ""]
            i = j
        else:
            out.append(line)
            i += 1
    return "\n".join(out)


def markdown(text: str) -> str:
    """``text`` with reST roles as code spans and literal blocks fenced."""
    text = ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    return literal_blocks(text)


class RestRoles(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
