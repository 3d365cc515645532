"""Progress bars on a rank: ``tqdm.auto`` draws its text bar, which the notebook can show.

A rank is an ipyparallel engine, a Jupyter kernel of its own, so ``tqdm.auto`` would pick its
widget bar there. A widget's model lives in the kernel that made it: the notebook could never
draw it, and every update would go nowhere, leaving no trace of the bar. ``tqdm.autonotebook``
(what ``tqdm.auto`` asks) decides once, when first imported, and picks the text bar outside a
kernel; importing it before the rank becomes an engine fixes that choice. The text bar goes to
stderr, and the notebook shows each redraw in place, tagged ``[rank N]``.
"""

from __future__ import annotations


def prefer_text_bars() -> None:
    """Make ``tqdm.auto`` draw text on this rank. Call before the engine starts (before
    ``ipykernel.zmqshell`` is imported); costs nothing without tqdm."""
    try:
        import tqdm.autonotebook  # noqa: F401  (its choice is made on import)
    except ImportError:
        pass
