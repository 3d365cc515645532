"""Before a cell is sent to the ranks: its syntax, checked here (nothing runs anywhere when it
is wrong), and ranks still busy with an earlier request, which the cell would queue behind."""

from __future__ import annotations

import functools
import time

from ipydist.errors import ClusterError
from ipydist.specs import describe_ranks


@functools.cache
def _transformer():
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


#: How long a cell waits for ranks still busy with an earlier request before it says so.
BUSY_WAIT_SECONDS = 2.0


def wait_until_idle(cluster, targets: list[int], restart: str) -> None:
    """A cell sent to a rank still busy (an earlier cell that did not stop when released, or
    a recovery that has not ended) would queue behind it and seem to hang: say so instead."""
    deadline = time.monotonic() + BUSY_WAIT_SECONDS
    while busy := cluster.busy_ranks(targets):
        if time.monotonic() > deadline:
            one = len(busy) == 1
            raise ClusterError(
                f"{describe_ranks(busy)} {'is' if one else 'are'} still running an earlier "
                "request (a cell that did not stop when released, or a recovery), so this cell "
                f"would wait behind it. Wait for {'it' if one else 'them'} to finish, "
                f"or run {restart}.")
        time.sleep(0.05)


@functools.lru_cache(maxsize=256)
def check_syntax(code: str) -> None:
    """Raise SyntaxError here, before the cell reaches any rank (IPython syntax allowed).

    Cached by source: a cell run again (a training loop re-run after a change elsewhere) is
    not parsed again. A cell that raised is not cached, so it is reported every time.
    """
    compile(_transformer().transform_cell(code), "<everyrank cell>", "exec")
