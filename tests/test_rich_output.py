"""Rich outputs of rank 0 reach the notebook: display(), matplotlib figures, the last value.

Run through nbclient in a real kernel, where they arrive as display_data / execute_result.
"""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    "%load_ext ipydist\n%dist_start --np 2",
    "%%everyrank\nimport ipydist.torch as hvd\nfrom IPython.display import HTML, display\n"
    "display(HTML(f'<b>hello from rank {hvd.rank()}</b>'))",
    "%%everyrank\nimport matplotlib.pyplot as plt\nplt.plot([0, 1], [hvd.rank(), 1])\nplt.show()",
    "%%everyrank\n6 * 7",
    "%dist_stop",
]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    return [c.outputs for c in nb.cells]


def test_display_shows_rank0_only(outputs):
    html = [o.data["text/html"] for o in outputs[1] if "text/html" in o.get("data", {})]
    assert html == ["<b>hello from rank 0</b>"]


def test_matplotlib_figure_of_rank0_is_shown(outputs):
    images = [o for o in outputs[2] if "image/png" in o.get("data", {})]
    assert len(images) == 1


def test_last_expression_is_the_cell_result(outputs):
    results = [o for o in outputs[3] if o.output_type == "execute_result"]
    assert [r.data["text/plain"] for r in results] == ["42"]
