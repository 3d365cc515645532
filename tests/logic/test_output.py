"""Pure logic of merging the ranks' output lines."""

from ipydist.notebook.output.lines import (
    ALL,
    HOLD_SECONDS,
    MAX_HOLD_SECONDS,
    FirstLines,
    LineMerger,
    Redraw,
    hold_for_load,
)


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


def test_the_hold_grows_with_the_machine_s_load_within_bounds():
    assert hold_for_load(0.3, 2) == HOLD_SECONDS  # idle: the shortest wait
    assert hold_for_load(2.0, 2) == HOLD_SECONDS  # one process per CPU
    assert hold_for_load(6.0, 2) == 3 * HOLD_SECONDS  # three per CPU: three times as long
    assert hold_for_load(500.0, 2) == MAX_HOLD_SECONDS
    assert hold_for_load(4.0, 0) == 4 * HOLD_SECONDS  # no CPU count: taken as one


def test_partial_lines_wait_for_their_newline_or_the_end():
    m = LineMerger([0, 1], hold=0.0)
    m.feed(0, "stdout", "hel", now=0.0)
    assert m.ready(now=1.0) == []
    m.feed(0, "stdout", "lo\nwor", now=1.0)
    assert m.ready(now=2.0) == [("rank 0", "stdout", "hello\n")]
    assert m.flush() == [("rank 0", "stdout", "wor\n")]


def test_mpi_s_report_of_a_collective_a_dead_rank_ended_is_left_out():
    m = LineMerger([0], hold=0.0)
    m.feed(0, "stderr", "NBC_Progress: an error 75 was found during schedule 0x55 at "
           "row-offset 0 - aborting the schedule\n\n", now=0.0)
    m.feed(0, "stderr", "\nTraceback (most recent call last):\n", now=0.0)
    assert m.ready(now=0.0) == [("rank 0", "stderr", "\n"),
                                ("rank 0", "stderr", "Traceback (most recent call last):\n")]


def test_streams_are_separate_and_one_rank_is_never_all():
    m = LineMerger([3], hold=0.0)
    m.feed(3, "stderr", "warn\n", now=0.0)
    m.feed(3, "stdout", "out\n", now=0.0)
    assert m.ready(now=0.0) == [("rank 3", "stderr", "warn\n"), ("rank 3", "stdout", "out\n")]


def test_a_rank_s_lines_keep_their_order_across_stdout_and_stderr():
    # each rank prints a line of its own, then starts a bar: the bars' first states are alike,
    # but no bar may come out before the line its rank printed first
    m = LineMerger([0, 1], hold=0.25)
    for r in (0, 1):
        m.feed(r, "stdout", f"hello from {r}\n", now=0.0)
        m.feed(r, "stderr", "\r  0%|          | 0/50", now=0.01)
        m.feed(r, "stderr", "\r 10%|#         | 5/50", now=0.02)
    assert m.ready(now=0.1) == []  # the hello lines are held (they might still merge)
    assert m.ready(now=0.3) == [("rank 0", "stdout", "hello from 0\n"),
                                ("rank 1", "stdout", "hello from 1\n"),
                                ("rank 0", "stderr", "  0%|          | 0/50\r"),
                                ("rank 1", "stderr", "  0%|          | 0/50\r")]


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


def test_at_the_end_a_progress_bar_shows_its_last_state_once_per_rank():
    m = LineMerger([0, 1], hold=0.0)
    for r in (0, 1):
        m.feed(r, "stdout", "\rstep 1\rstep 2", now=0.0)
    # alike on every rank, but a bar is never merged: each rank's is drawn in place
    assert m.ready(now=0.0) == [("rank 0", "stdout", "step 1\r"),
                                ("rank 1", "stdout", "step 1\r")]
    last = m.flush()
    assert last == [("rank 0", "stdout", "step 2\n"), ("rank 1", "stdout", "step 2\n")]
    assert all(isinstance(line, Redraw) and line.last for _, _, line in last)


def test_a_bar_s_states_go_out_at_once_and_its_newline_ends_it():
    m = LineMerger([0, 1], hold=10.0)
    m.feed(0, "stderr", "\r 50%|#####     | 1/2", now=0.0)
    m.feed(0, "stderr", "\r100%|##########| 2/2", now=0.0)
    [(tag, _, state)] = m.ready(now=0.0)  # no hold: nothing to merge a bar with
    assert (tag, state, isinstance(state, Redraw), state.last) == (
        "rank 0", " 50%|#####     | 1/2\r", True, False)
    m.feed(0, "stderr", "\n", now=0.1)
    [(_, _, final)] = m.ready(now=0.1)
    assert (final, final.last) == ("100%|##########| 2/2\n", True)
    m.feed(0, "stderr", "after the bar\n", now=0.2)
    [(_, _, line)] = m.ready(now=20.0)
    assert line == "after the bar\n" and not isinstance(line, Redraw)


def test_a_blank_redraw_between_states_shows_nothing():
    # tqdm.write clears its bar with "\r" + spaces + "\r", prints the message, redraws
    m = LineMerger([0], hold=0.0)
    m.feed(0, "stderr", "\r 10%|#    | 1/10\r            \rmessage\n\r 10%|#    | 1/10", now=0.0)
    out = [line for _, _, line in m.ready(now=0.0)]
    assert out == [" 10%|#    | 1/10\r", "message\n"]
    assert out[1].last  # the message ends the bar's line; the redraw after it starts anew
    assert m.flush() == [("rank 0", "stderr", " 10%|#    | 1/10\n")]


def test_a_cells_first_lines_wait_for_its_chart_at_most_a_while():
    """FirstLines: the first output waits for the chart (so the chart sits above it), for at
    most its seconds; then, or once released, nothing is held."""
    first = FirstLines(seconds=0.5)
    assert first.take(["a"], charted=False, now=10.0) == []
    assert first.take(["b"], charted=False, now=10.2) == []
    assert first.take(["c"], charted=True, now=10.3) == ["a", "b", "c"], "the chart opened"
    assert first.take(["d"], charted=False, now=10.4) == ["d"], "over: nothing held"
    timed = FirstLines(seconds=0.5)
    assert timed.take([], charted=False, now=0.0) == [], "no line yet: the clock waits too"
    assert timed.take(["a"], charted=False, now=5.0) == []
    assert timed.take([], charted=False, now=5.6) == ["a"], "no point came in time"
    flushed = FirstLines(seconds=0.5)
    flushed.take(["a"], charted=False, now=0.0)
    assert flushed.take(["b"], charted=False, now=0.1, hold=False) == ["a", "b"], (
        "a flush (the cell's end, a breakpoint) releases it")


def test_display_updates_are_trusted_to_the_front_ends_that_apply_them():
    from ipydist.notebook.output.display import applies_updates

    def request(metadata: dict, allow_stdin: bool) -> dict:
        return {"metadata": metadata, "content": {"code": "1", "allow_stdin": allow_stdin}}

    # JupyterLab, Notebook 7 and VS Code name the cell
    assert applies_updates(request({"cellId": "a1", "recordTiming": False}, True))
    assert applies_updates(request({}, False)), "nbclient (nbconvert, papermill): no stdin"
    assert not applies_updates(request({}, True)), (
        "jupyter-server-nbmodel's server-side execution (or a console) drops the updates")
    assert applies_updates({}), "no request: nothing to ask"
