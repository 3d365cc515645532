"""The start options, declared once (``ipydist.StartOptions``): checked when made, refused by
name when unknown, the same from the magic's line as from ``Session(...)``, and kept in
``session.options`` only (pure logic: no cluster starts)."""

from __future__ import annotations

import dataclasses

import pytest
from IPython.core.magic_arguments import parse_argstring

import ipydist
from ipydist.magics import DistMagics
from ipydist.notebook.start_options import options_of
from ipydist.specs import SpecError, StartOptions


def test_values_are_checked_and_normalised_when_the_options_are_made():
    options = StartOptions(np="4", gpus="0,1", env=["A=1"], timeout="30", min_np="2")
    assert (options.np, options.gpus, options.env, options.timeout, options.min_np) == (
        4, [0, 1], {"A": "1"}, 30.0, 2)
    with pytest.raises(SpecError, match="--np 0: the number of ranks"):
        StartOptions(np=0)
    with pytest.raises(SpecError, match="--stall-warning -1"):
        StartOptions(stall_warning=-1)
    with pytest.raises(SpecError, match="--backend tpu"):
        StartOptions().changed(backend="tpu")  # a change is checked as a new one is


def test_an_unknown_option_is_refused_with_the_names_there_are():
    with pytest.raises(SpecError, match="nps: no such start option; the options are np, gpus"):
        ipydist.Session(nps=4)


def test_the_magic_s_line_and_session_s_keywords_make_the_same_options(magics):
    line = ("--np 3 --gpus none --env A=1 B=2 --time 1:00:00 --no-init --no-elastic "
            "--stall-warning 0")
    from_line = options_of(parse_argstring(DistMagics.dist_start, line))
    from_python = StartOptions(np=3, gpus="none", env={"A": "1", "B": "2"},
                               time_limit="1:00:00", init=False, elastic=False,
                               stall_warning=0)
    assert from_line == from_python
    # the kernel's --np (install-kernel) fills the line's np only where it gave none
    assert options_of(parse_argstring(DistMagics.dist_start, ""), np=5).np == 5
    assert options_of(parse_argstring(DistMagics.dist_start, "--np 2"), np=5).np == 2


def test_a_start_option_set_on_a_session_is_refused_not_ignored():
    session = ipydist.Session(np=2, gpus="none")
    with pytest.raises(AttributeError, match="failure_grace is a start option, kept in "
                       r"session.options: .*session.options.changed\(failure_grace=...\)"):
        session.failure_grace = 1.0
    session.options = session.options.changed(failure_grace=1.0)
    assert session.options.failure_grace == 1.0 and session.np == 2
    assert dataclasses.replace(session.options, np=3).np == 3
