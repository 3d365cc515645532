"""Pure logic of merging the ranks' output lines."""

from ipydist.notebook.output.lines import ALL, LineMerger


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


def test_a_text_progress_bar_keeps_its_tag_on_every_redraw():
    m = LineMerger([0, 1], hold=0.0)
    # tqdm in text mode: "\r" before each state, "\n" when it closes
    m.feed(1, "stderr", "\r  0%|          | 0/3", now=0.0)
    m.feed(1, "stderr", "\r 33%|###       | 1/3\r 67%|######    | 2/3", now=0.1)
    assert m.ready(now=0.2) == [("rank 1", "stderr", "  0%|          | 0/3\r"),
                                ("rank 1", "stderr", " 33%|###       | 1/3\r")]
    m.feed(1, "stderr", "\r100%|##########| 3/3\n", now=0.3)
    assert m.ready(now=0.4) == [("rank 1", "stderr", " 67%|######    | 2/3\r"),
                                ("rank 1", "stderr", "100%|##########| 3/3\n")]


def test_a_crlf_split_between_two_messages_is_one_line_end():
    m = LineMerger([0], hold=0.0)
    m.feed(0, "stdout", "windows line\r", now=0.0)
    assert m.ready(now=0.1) == []
    m.feed(0, "stdout", "\nnext", now=0.1)
    assert m.ready(now=0.2) == [("rank 0", "stdout", "windows line\n")]
    assert m.flush() == [("rank 0", "stdout", "next\n")]


def test_at_the_end_a_progress_bar_shows_its_last_state_once():
    m = LineMerger([0, 1], hold=0.0)
    for r in (0, 1):
        m.feed(r, "stdout", "\rstep 1\rstep 2", now=0.0)
    assert m.ready(now=0.0) == [(ALL, "stdout", "step 1\r")]
    assert m.flush() == [(ALL, "stdout", "step 2\n")]
