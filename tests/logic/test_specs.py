"""Pure logic: rank specs, K=V pairs, error rendering."""

import pytest
from ipyparallel.error import RemoteError

from ipydist.errors import RankError
from ipydist.specs import SpecError, describe_ranks, format_ranks, parse_env, parse_ranks


@pytest.mark.parametrize(
    "spec, expected",
    [(None, [0, 1, 2, 3]), ("0", [0]), ("0,2", [0, 2]), ("1-3", [1, 2, 3]),
     ("3,0-1", [0, 1, 3]), (" 1 , 2 ", [1, 2]), (2, [2]), ([3, 1], [1, 3])],
)
def test_parse_ranks(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize("spec", ["x", "1-", "-1", "1,,2", "2-1", "1.5", ""])
def test_parse_ranks_rejects_malformed(spec):
    with pytest.raises(SpecError, match="expected a rank"):
        parse_ranks(spec, 4)


def test_parse_ranks_rejects_missing_ranks():
    with pytest.raises(SpecError, match="this cluster has ranks 0-3; 7 does not exist"):
        parse_ranks("7", 4)
    with pytest.raises(SpecError, match="4-5 do not exist"):
        parse_ranks("2-5", 4)


def test_format_and_describe_ranks():
    assert format_ranks([5, 0, 1, 2]) == "0-2,5"
    assert parse_ranks(format_ranks([0, 2, 3, 7]), 8) == [0, 2, 3, 7]
    assert describe_ranks([2]) == "rank 2" and describe_ranks([1, 2]) == "ranks 1-2"


def test_parse_env():
    assert parse_env(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    assert parse_env(None) == {}
    for bad in ["A", "=1", "1A=2", "A-B=1"]:
        with pytest.raises(SpecError, match="expected NAME=VALUE"):
            parse_env([bad])


def test_rank_error_shows_first_rank_and_groups_the_same():
    boom = RemoteError("ValueError", "boom", "Traceback...\nValueError: boom")
    other = RemoteError("KeyError", "'k'", "Traceback...\nKeyError: 'k'")
    err = RankError({3: boom, 1: boom, 2: other})
    assert err.ranks == [1, 2, 3]
    assert str(err) == "ranks 1-3 raised in the cell: ValueError: boom"
    lines = err._render_traceback_()
    assert lines[2] == "--- rank 1 ---"
    assert "(rank 3: the same ValueError)" in lines
    assert "--- rank 2 ---" in lines and "KeyError: 'k'" in lines
