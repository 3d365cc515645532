"""The rank calls' table (``protocol.RankCall``): every call the notebook makes is declared once,
the rank side has it with the declared reply, and no call site names one by a bare string."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from ipydist import protocol

SRC = Path(protocol.__file__).parent
DECLARED = [value for value in vars(protocol).values() if isinstance(value, protocol.RankCall)]


def test_the_table_holds_every_declared_call_once():
    assert sorted(c.name for c in DECLARED) == sorted(protocol.RANK_CALL_TABLE)
    assert len({c.name for c in DECLARED}) == len(DECLARED)


@pytest.mark.parametrize("call", DECLARED, ids=lambda c: c.name)
def test_the_rank_side_has_each_call_with_its_declared_reply(call):
    from ipydist.rank import calls

    function = getattr(calls, call.name, None)
    assert callable(function), f"ipydist.rank.calls has no {call.name}()"
    assert typing.get_type_hints(function)["return"] == call.reply, call.name


def test_no_call_site_names_a_rank_call_by_a_string():
    """``Cluster.call`` and ``protocol.on_rank`` take a RankCall: a string would reach the rank
    side unchecked (and the type check would not know its reply)."""
    pattern = re.compile(r"""(?:\.call\(|on_rank,)\s*["']""")
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_a_call_travels_by_name_and_arrives_as_the_ranks_own():
    import pickle

    for call in DECLARED:
        sent = pickle.dumps(call)
        assert len(sent) < 100 and pickle.loads(sent) is protocol.RANK_CALL_TABLE[call.name]
