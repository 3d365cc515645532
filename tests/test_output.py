"""Pure logic of merging the ranks' output lines."""

from ipydist.notebook.lines import ALL, LineMerger


def test_identical_lines_are_shown_once():
    m = LineMerger([0, 1, 2], hold=0.25)
    for r in (0, 1, 2):
        m.feed(r, "stdout", "epoch 1\n", now=0.0)
    assert m.ready(now=0.0) == [(ALL, "stdout", "epoch 1\n")]
    assert m.flush() == []


def test_different_lines_wait_for_the_hold_then_go_out_tagged():
    m = LineMerger([0, 1], hold=0.25)
    m.feed(0, "stdout", "rank zero\n", now=0.0)
    m.feed(1, "stdout", "rank one\n", now=0.1)
    assert m.ready(now=0.2) == []
    assert m.ready(now=0.3) == [("rank 0", "stdout", "rank zero\n")]
    assert m.ready(now=0.4) == [("rank 1", "stdout", "rank one\n")]


def test_a_late_rank_still_merges_within_the_hold():
    m = LineMerger([0, 1], hold=0.25)
    m.feed(0, "stdout", "loss 0.5\n", now=0.0)
    assert m.ready(now=0.1) == []
    m.feed(1, "stdout", "loss 0.5\n", now=0.2)
    assert m.ready(now=0.2) == [(ALL, "stdout", "loss 0.5\n")]


def test_partial_lines_wait_for_their_newline_or_the_end():
    m = LineMerger([0, 1], hold=0.0)
    m.feed(0, "stdout", "hel", now=0.0)
    assert m.ready(now=1.0) == []
    m.feed(0, "stdout", "lo\nwor", now=1.0)
    assert m.ready(now=2.0) == [("rank 0", "stdout", "hello\n")]
    assert m.flush() == [("rank 0", "stdout", "wor\n")]


def test_streams_are_separate_and_one_rank_is_never_all():
    m = LineMerger([3], hold=0.0)
    m.feed(3, "stderr", "warn\n", now=0.0)
    m.feed(3, "stdout", "out\n", now=0.0)
    assert m.ready(now=0.0) == [("rank 3", "stdout", "out\n"), ("rank 3", "stderr", "warn\n")]
