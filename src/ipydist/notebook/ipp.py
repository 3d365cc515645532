"""The few ipyparallel internals ipydist relies on, in one place.

ipyparallel has no public API for "which of this request's engines are done" or "does this
client have a request pending on engine N"; both are read from attributes that have been
stable since ipyparallel 7. If a release changes them, this module is the one to adapt.
"""

from __future__ import annotations


def per_rank(async_result, targets: list[int]) -> dict:
    """rank -> that rank's future within ``async_result`` (a request sent to ``targets``)."""
    return dict(zip(targets, async_result._children))


def still_running(async_result, targets: list[int]) -> list[int]:
    """The ranks of ``targets`` that have not replied to ``async_result`` yet."""
    return [r for r, child in per_rank(async_result, targets).items() if not child.done()]


def outcomes(async_result, targets: list[int]) -> dict[int, str]:
    """rank -> ``"running"``, ``"finished"`` or ``"failed"`` for one request."""
    out = {}
    for rank, child in per_rank(async_result, targets).items():
        if not child.done():
            out[rank] = "running"
        else:
            out[rank] = "failed" if isinstance(child.result(), Exception) else "finished"
    return out


def has_pending_requests(client, engine_id: int) -> bool:
    """Whether a request of ``client``'s is still running or queued on an engine.

    Asked of the client, which knows the moment a reply arrives; the controller's
    queue_status() learns it a little later, so right after a cell it can still say busy.
    """
    uuid = client._engines.get(engine_id)
    return bool(uuid and client._outstanding_dict.get(uuid))
