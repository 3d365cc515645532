"""Questions to the ranks on their engines' control channel, which each engine serves in a
thread of its own: answered while a rank runs a cell (its stack, a pdb command, a completion;
the rank side is :mod:`ipydist.rank.control`)."""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout

from ipydist import protocol
from ipydist.notebook import ipp


def ask_ranks(cluster, ranks: list[int], request: dict,
              timeout: float) -> dict[int, dict | None]:
    """rank -> the content of its answer to ``request`` on its control channel (which a rank
    answers while it runs a cell), asked of every rank at once; None for a rank that did not
    answer within ``timeout`` seconds in all."""
    futures = {rank: ipp.ask_on_control(cluster.client, cluster.engine_ids[rank],
                                        protocol.CONTROL_REQUEST, request)
               for rank in ranks}
    deadline = time.monotonic() + timeout
    found: dict[int, dict | None] = {}
    for rank, future in futures.items():
        try:
            found[rank] = future.result(timeout=max(0.0, deadline - time.monotonic()))["content"]
        except FutureTimeout:
            found[rank] = None
    return found


def tell_rank(cluster, rank: int, request: dict) -> None:
    """Send ``request`` to ``rank``'s control channel without waiting for its answer (which the
    client drops when it comes)."""
    ipp.ask_on_control(cluster.client, cluster.engine_ids[rank], protocol.CONTROL_REQUEST,
                       request)
