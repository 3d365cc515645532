"""Pure logic of the ranks' rich output: which displays are shown, tagged how, in which order
among the printed lines, and what is said of widgets."""

from ipydist.notebook.output.lines import ALL, LineMerger
from ipydist.notebook.output.rich import WIDGET_MIME, Display, DisplayBook


def html(text: str) -> dict:
    return {"data": {"text/html": text, "text/plain": "<HTML>"}, "metadata": {}}


def test_displays_are_equal_by_their_data_whatever_the_rank():
    assert Display(0, {"text/html": "a"}) == Display(1, {"text/html": "a"})
    assert Display(0, {"text/html": "a"}) != Display(0, {"text/html": "b"})
    assert len({Display(0, {"text/html": "a"}), Display(3, {"text/html": "a"})}) == 1


def test_the_first_ranks_display_has_no_tag_and_anothers_has_one():
    book = DisplayBook([0, 1, 2])
    step = book.accept("rank 0", book.take(0, html("zero")))
    assert (step.kind, step.shown.tag) == ("show", None)
    step = book.accept("rank 2", book.take(2, html("two")))
    assert (step.kind, step.shown.tag) == ("show", "[rank 2]")


def test_the_first_shown_rank_is_the_first_target_not_rank_0():
    book = DisplayBook([2, 3])
    assert book.accept("rank 2", book.take(2, html("x"))).shown.tag is None


def test_a_bundle_every_rank_displayed_is_shown_once_without_a_tag():
    book = DisplayBook([0, 1])
    step = book.accept(ALL, book.take(0, html("same")))
    assert (step.kind, step.shown.tag) == ("show", None)


def test_a_late_copy_of_the_first_ranks_display_is_skipped():
    book = DisplayBook([0, 1])
    book.accept("rank 0", book.take(0, html("same")))
    assert book.accept("rank 1", book.take(1, html("same"))).kind == "skip"


def test_when_the_first_rank_lags_its_copy_removes_the_tag_shown_before():
    book = DisplayBook([0, 1])
    first = book.accept("rank 1", book.take(1, html("same")))
    assert (first.kind, first.shown.tag) == ("show", "[rank 1]")
    late = book.accept("rank 0", book.take(0, html("same")))
    assert (late.kind, late.shown.tag) == ("retag", None)
    assert late.shown is first.shown  # the handle kept with the first copy is the one to change


def test_copies_from_other_ranks_are_named_in_one_tag():
    book = DisplayBook([0, 1, 2, 3])
    book.accept("rank 1", book.take(1, html("same")))
    step = book.accept("rank 2", book.take(2, html("same")))
    assert (step.kind, step.shown.tag) == ("retag", "[ranks 1-2]")
    assert book.accept("rank 2", book.take(2, html("same"))).kind == "skip"


def test_different_bundles_are_each_shown():
    book = DisplayBook([0, 1])
    kinds = [book.accept(f"rank {r}", book.take(r, html(f"from {r}"))).kind for r in (0, 1)]
    assert kinds == ["show", "show"]


def test_a_widget_view_is_dropped_and_the_rest_of_its_bundle_kept():
    book = DisplayBook([0, 1])
    content = {"data": {WIDGET_MIME: {"model_id": "abc"}, "text/plain": "Fig",
                        "image/png": "iVBO"}, "metadata": {}}
    item = book.take(1, content)
    assert item.data == {"text/plain": "Fig", "image/png": "iVBO"}
    assert book.note() is None


def test_a_widget_with_only_its_repr_is_named_once_under_the_cell():
    book = DisplayBook([0, 1])
    bar = {"data": {WIDGET_MIME: {"model_id": "a"}, "text/plain": "r1:   0%|   | 0/3"}}
    assert book.take(1, bar) is None
    assert book.take(1, bar) is None
    note = book.note()
    assert note.startswith("ipydist: rank 1 displayed 2 widgets (r1: 0%| | 0/3), which")
    assert "from tqdm import tqdm" in note and "%dist_pull" in note


def test_widgets_from_several_ranks_are_named_in_one_note():
    book = DisplayBook([0, 1])
    for r in (0, 1):
        book.take(r, {"data": {WIDGET_MIME: {}, "text/plain": "IntSlider(value=0)"}})
    assert book.note().startswith(
        "ipydist: ranks 0-1 displayed 2 widgets (IntSlider(value=0)), which")


def test_nothing_to_show_is_no_display_and_no_note():
    book = DisplayBook([0])
    assert book.take(0, {"data": {}, "metadata": {}}) is None
    assert book.note() is None


def test_a_display_comes_after_what_its_rank_printed_before_it():
    m = LineMerger([0, 1], hold=0.25)
    fig = Display(1, {"image/png": "x"})
    m.feed(1, "stdout", "before\n", now=0.0)
    m.put(1, fig, now=0.1)
    m.feed(1, "stdout", "after\n", now=0.2)
    assert m.flush() == [("rank 1", "stdout", "before\n"), ("rank 1", "display", fig),
                         ("rank 1", "stdout", "after\n")]


def test_a_display_waits_for_its_ranks_earlier_stderr_lines():
    m = LineMerger([0, 1], hold=0.25)
    fig = Display(1, {"image/png": "x"})
    m.feed(1, "stderr", "warning\n", now=0.0)
    m.feed(1, "stderr", "\r 50%|#####     | 1/2", now=0.05)
    m.put(1, fig, now=0.1)  # the unfinished bar state ends before the display
    m.feed(1, "stderr", "later\n", now=0.2)
    assert m.ready(now=0.3) == [("rank 1", "stderr", "warning\n")]
    assert m.ready(now=0.36) == [("rank 1", "stderr", " 50%|#####     | 1/2\n"),
                                 ("rank 1", "display", fig)]
    assert m.flush() == [("rank 1", "stderr", "later\n")]


def test_a_display_every_rank_made_alike_merges_like_a_line():
    m = LineMerger([0, 1], hold=0.25)
    m.put(0, Display(0, {"text/html": "same"}), now=0.0)
    assert m.ready(now=0.1) == []
    m.put(1, Display(1, {"text/html": "same"}), now=0.2)
    [(tag, stream, item)] = m.ready(now=0.2)
    assert (tag, stream, item.rank) == (ALL, "display", 0)


def test_one_ranks_display_does_not_keep_the_lines_after_it_from_merging():
    # if hvd.rank() == 0: plt.show(), then every rank prints the same line
    m = LineMerger([0, 1], hold=0.25)
    fig = Display(0, {"image/png": "x"})
    m.put(0, fig, now=0.0)
    m.feed(0, "stdout", "epoch 1\n", now=0.05)
    m.feed(1, "stdout", "epoch 1\n", now=0.05)
    assert m.ready(now=0.05) == [("rank 0", "display", fig), (ALL, "stdout", "epoch 1\n")]


def test_lines_every_rank_printed_after_a_display_every_rank_made_merge_after_it():
    m = LineMerger([0, 1], hold=0.25)
    for r in (0, 1):
        m.put(r, Display(r, {"text/html": "same"}), now=0.0)
        m.feed(r, "stdout", "done\n", now=0.0)
    [(tag, stream, item), line] = m.ready(now=0.0)
    assert (tag, stream, item.rank) == (ALL, "display", 0)
    assert line == (ALL, "stdout", "done\n")
