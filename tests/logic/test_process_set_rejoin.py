"""Process sets after the world changed (pure logic: no ranks, so no communicators are made):
a replacement adopts the others' sets by id; after a shrink or after going on without dead
ranks, sets that name a rank that is gone are removed and the others renumbered."""

from __future__ import annotations

import pytest

from ipydist.torch.horovod import process_sets


@pytest.fixture
def sets(monkeypatch):
    monkeypatch.setattr(process_sets, "_sets", {})
    monkeypatch.setattr(process_sets, "_next_id", 1)
    process_sets.adopt(([(1, [0, 2]), (2, [1, 3]), (4, [2, 3])], 5))
    return process_sets._sets


def test_a_new_rank_adopts_the_sets_by_their_ids(sets):
    assert {i: s.ranks for i, s in sets.items()} == {1: [0, 2], 2: [1, 3], 4: [2, 3]}
    assert process_sets.registry() == ([(1, [0, 2]), (2, [1, 3]), (4, [2, 3])], 5)
    # a copied variable that names set 2 unpickles as that very set
    assert process_sets._the_set(2, [1, 3]) is sets[2]


def test_going_on_without_rank_1_removes_its_sets_and_renumbers_the_rest(sets):
    removed = process_sets.rejoin(3, gone=[1])
    assert removed == ["the process set of ranks 1 and 3"]
    assert {i: s.ranks for i, s in sets.items()} == {1: [0, 1], 4: [1, 2]}


def test_shrinking_removes_the_sets_of_ranks_that_left(sets):
    third = sets[4]
    assert process_sets.rejoin(3) == ["the process set of ranks 1 and 3",
                                      "the process set of ranks 2-3"]
    assert list(sets) == [1] and third.process_set_id is None
