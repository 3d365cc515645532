"""Rich outputs of the ranks reach the notebook: display(), matplotlib figures, the last value.

Run through nbclient in a real kernel, where they arrive as display_data / execute_result. Every
rank's displays are shown (as ipyparallel's %%px does); one not from the first rank follows a
``[rank N]`` tag line; a bundle every rank displayed alike is shown once; a rank's widget is
never sent on (its model is not in the notebook's kernel), and tqdm.auto draws text on a rank.
"""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from ipydist.cli.run import execute_starting_again

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
HTML_OF_EACH_RANK = "display(HTML(f'<b>hello from rank {hvd.rank()}</b>'))"

CELLS = {
    "start": "%load_ext ipydist\n%dist_start --np 2",
    "each": "%%everyrank\nimport ipydist.torch as hvd\nfrom IPython.display import HTML, display\n"
            + HTML_OF_EACH_RANK,
    "rank1_html": "%%everyrank\nif hvd.rank() == 1:\n    print('before')\n"
                  "    display(HTML('<i>only rank 1</i>'))\n    print('after')",
    "rank1_figure": "%%everyrank\nimport matplotlib.pyplot as plt\nif hvd.rank() == 1:\n"
                    "    plt.plot([0, 1], [1, 0])\n    plt.show()",
    "same": "%%everyrank\ndisplay(HTML('<b>the same everywhere</b>'))",
    "rank0_then_line": "%%everyrank\nif hvd.rank() == 0:\n    display(HTML('<b>chart</b>'))\n"
                       "print('epoch 1')",
    # rank 0 lags past the longest wait for the other ranks' copies (1 s, on a loaded machine)
    "rank0_lags": "%%everyrank\nimport time\nif hvd.rank() == 0:\n    time.sleep(2.5)\n"
                  "display(HTML('<b>late on rank 0</b>'))",
    "rank0": "%%everyrank --output rank0\n" + HTML_OF_EACH_RANK,
    "tqdm_auto": "%%everyrank\nfrom tqdm.auto import tqdm\nimport time\nif hvd.rank() == 1:\n"
                 "    for _ in tqdm(range(3), desc='rank1 bar', mininterval=0):\n"
                 "        time.sleep(0.05)",
    "widget": "%%everyrank\nimport ipywidgets\nif hvd.rank() == 1:\n"
              "    display(ipywidgets.IntSlider(value=7))",
    "value": "%%everyrank\n6 * 7",
    "stop": "%dist_stop",
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(c) for c in CELLS.values()])
    # a kernel that dies before it answers (a port taken between its choice and its bind) is
    # started again, as ipydist run does
    execute_starting_again(lambda: NotebookClient(nb, timeout=300, kernel_name="python3"))
    return {name: cell.outputs for name, cell in zip(CELLS, nb.cells)}


def transcript(outputs) -> list[str]:
    """The cell's outputs in order, one string each: ``out:``/``err:`` text, ``tag:`` a
    plain-text display (a rank's tag line), ``html:``, ``png``."""
    seen = []
    for o in outputs:
        if o.output_type == "stream":
            seen.append(f"{'out' if o.name == 'stdout' else 'err'}:{o.text}")
        elif o.output_type == "display_data":
            data = o.data
            if "text/html" in data:
                seen.append(f"html:{data['text/html']}")
            elif "image/png" in data:
                seen.append("png")
            elif data.get("text/plain"):  # a tag emptied when the first rank's copy came late
                seen.append(f"tag:{data['text/plain']}")
    return seen


def tagged_displays(outputs) -> list[tuple[str | None, str]]:
    """(its tag line or None, html) for each HTML display, in rank order whatever order the
    ranks' displays arrived in."""
    seen, tag = [], None
    for entry in transcript(outputs):
        if entry.startswith("tag:"):
            tag = entry[4:]
        elif entry.startswith("html:"):
            seen.append((tag, entry[5:]))
            tag = None
    return sorted(seen, key=lambda pair: pair[1])


def test_every_ranks_display_is_shown_and_another_ranks_is_tagged(outputs):
    assert tagged_displays(outputs["each"]) == [
        (None, "<b>hello from rank 0</b>"), ("[rank 1]", "<b>hello from rank 1</b>")]


def test_a_display_from_rank_1_only_is_shown_tagged_in_order_with_its_lines(outputs):
    assert transcript(outputs["rank1_html"]) == [
        "out:[rank 1] before\n", "tag:[rank 1]", "html:<i>only rank 1</i>",
        "out:[rank 1] after\n"]


def test_a_matplotlib_figure_of_rank_1_only_is_shown_tagged(outputs):
    assert transcript(outputs["rank1_figure"]) == ["tag:[rank 1]", "png"]


def test_a_display_every_rank_made_alike_is_shown_once(outputs):
    assert transcript(outputs["same"]) == ["html:<b>the same everywhere</b>"]


def test_rank_0s_display_does_not_keep_the_lines_after_it_from_merging(outputs):
    assert transcript(outputs["rank0_then_line"]) == [
        "html:<b>chart</b>", "out:[all ranks] epoch 1\n"]


def test_when_rank_0_displays_the_same_late_the_tag_shown_before_is_emptied(outputs):
    displays = [o.data for o in outputs["rank0_lags"] if o.output_type == "display_data"]
    assert displays[0] == {"text/plain": ""}  # was [rank 1] until rank 0's copy came
    assert [d.get("text/html") for d in displays[1:]] == ["<b>late on rank 0</b>"]


def test_output_rank0_shows_the_first_ranks_display_only(outputs):
    assert transcript(outputs["rank0"]) == ["html:<b>hello from rank 0</b>"]


def test_a_tqdm_auto_bar_on_rank_1_is_text_tagged_by_rank(outputs):
    # one line, redrawn in place (a display updated by id; the saved notebook keeps its last
    # state), and no widget
    bars = [o for o in outputs["tqdm_auto"] if o.output_type == "display_data"]
    assert [set(o.data) for o in bars] == [{"text/plain"}], bars
    assert bars[0].data["text/plain"].startswith("[rank 1] rank1 bar:"), bars
    assert "3/3" in bars[0].data["text/plain"], bars
    err = "".join(o.text for o in outputs["tqdm_auto"] if o.output_type == "stream")
    assert "rank1 bar" not in err, err


def test_a_widget_on_a_rank_is_not_sent_on_and_said_once(outputs):
    assert not [o for o in outputs["widget"] if WIDGET_MIME in o.get("data", {})]
    err = [o.text for o in outputs["widget"] if o.output_type == "stream"]
    assert len(err) == 1 and err[0].startswith(
        "ipydist: rank 1 displayed a widget (IntSlider(value=7)), which the notebook cannot "
        "show"), err
    assert "from tqdm import tqdm" in err[0]


def test_no_widget_view_of_a_rank_ever_reaches_the_notebook(outputs):
    assert not [o for name, cell in outputs.items() for o in cell
                if WIDGET_MIME in o.get("data", {}) and name != "start"]
    # the start's only widget is the notebook's own live cluster view
    views = [o for o in outputs["start"] if WIDGET_MIME in o.get("data", {})]
    # (its text form says what it showed: for a plain-text viewer, an untrusted page)
    assert [v.data["text/plain"].split(":")[0] for v in views] == [
        "ipydist live cluster view"], views
    assert " ranks" in views[0].data["text/plain"], views


def test_last_expression_is_the_cell_result(outputs):
    results = [o for o in outputs["value"] if o.output_type == "execute_result"]
    assert [r.data["text/plain"] for r in results] == ["42"]
