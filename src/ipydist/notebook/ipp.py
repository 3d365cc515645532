"""The few ipyparallel internals ipydist relies on, in one place.

ipyparallel has no public API for "which of this request's engines are done", "does this
client have a request pending on engine N", "stop waiting for this reply" or "watch this
request's output from its first message"; all are read from (or written to) attributes that
have been stable since ipyparallel 7. If a release changes them, this module is the one to
adapt.
"""

from __future__ import annotations

from ipyparallel.client.asyncresult import AsyncResult


def wait(async_result, timeout: float, output: bool = False) -> bool:
    """``async_result.wait(timeout)`` (or ``wait_for_output``), where a Ctrl-C stays a
    KeyboardInterrupt. Both wait on a ``threading.Event``, and an interrupt that lands just
    before its Condition takes the lock back leaves the lock unheld: the ``with`` block then
    raises RuntimeError('release unlocked lock'), the interrupt only its context (once in 50
    random cells beside two hogs: the cell's ranks were not stopped). The lock is left free
    and the Event sound, so the interrupt is raised as it was meant."""
    try:
        return async_result.wait_for_output(timeout) if output else async_result.wait(timeout)
    except RuntimeError as error:
        if isinstance(error.__context__, KeyboardInterrupt):
            raise error.__context__ from None
        raise


def per_rank(async_result, targets: list[int]) -> dict:
    """rank -> that rank's future within ``async_result`` (a request sent to ``targets``)."""
    return dict(zip(targets, async_result._children))


def published(async_result, targets: list[int], rank: int, key: str):
    """The latest value ``rank`` published under ``key`` (``ipydist.rank.channel.publish``)
    while it ran this request; None if none yet."""
    future = per_rank(async_result, targets)[rank]
    return (future.output.metadata.get("data") or {}).get(key)


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


def engine_died(error: Exception) -> bool:
    """Whether ``error`` is ipyparallel's word that the engine's process ended before it
    answered (``EngineError``, as the reply of a request it was running)."""
    return getattr(error, "ename", type(error).__name__) == "EngineError"


def results(async_result, targets: list[int], ending=()) -> list:
    """The replies of ``targets`` in order, an error raised as ipyparallel raises it; but where
    a rank of ``ending`` (one whose process ends once it answered) was seen to end before its
    answer came, its reply is None."""
    if not ending:
        return async_result.get()
    replies = async_result.get(return_exceptions=True)
    for rank, reply in zip(targets, replies):
        if isinstance(reply, Exception) and not (rank in ending and engine_died(reply)):
            raise reply
    return [None if isinstance(reply, Exception) else reply for reply in replies]


def has_pending_requests(client, engine_id: int) -> bool:
    """Whether a request of ``client``'s is still running or queued on an engine.

    Asked of the client, which knows the moment a reply arrives; the controller's
    queue_status() learns it a little later, so right after a cell it can still say busy.
    """
    uuid = client._engines.get(engine_id)
    return bool(uuid and client._outstanding_dict.get(uuid))


def msg_id(async_result, targets: list[int], rank: int) -> str:
    """The id of ``rank``'s request within ``async_result`` (a request sent to ``targets``)."""
    return async_result.msg_ids[targets.index(rank)]


def replies(async_result, targets: list[int]) -> dict[int, object]:
    """rank -> reply (a result, or the exception it raised) for the ranks that replied."""
    return {rank: child.result() for rank, child in per_rank(async_result, targets).items()
            if child.done()}


def pages(reply) -> list[dict]:
    """What a rank's cell put in its pager (``obj?``, ``%pdoc``): the mime bundles of the
    ``page`` payloads of its execute reply, which ipyparallel keeps but does not show."""
    content = getattr(reply, "_content", None) or {}
    return [p["data"] for p in content.get("payload") or ()
            if p.get("source") == "page" and isinstance(p.get("data"), dict)]


def abort(client, msg_ids: list[str], ranks: list[int]) -> None:
    """Ask ``ranks`` to skip these requests if they have not begun them (the engine answers
    "aborted" when it reaches one); a request already running goes on."""
    client.abort(jobs=list(msg_ids), targets=list(ranks), block=False)


def forget(client, msg_id: str) -> None:
    """Stop waiting for a reply that will never come (it was lost on the way), so the engine
    no longer counts as busy with it."""
    client.outstanding.discard(msg_id)
    for pending in client._outstanding_dict.values():
        pending.discard(msg_id)


def execute(view, code: str, on_future, metadata: dict | None = None) -> AsyncResult:
    """``view.execute(code, silent=False, block=False)``, calling ``on_future(i, future)``
    with the i-th target's request future before that request is sent; ``metadata`` goes
    with each request.

    ``DirectView.execute`` returns the request only once it is sent, and a rank's output can
    arrive before the caller attaches its IOPub callbacks; ipyparallel then keeps it in the
    request's metadata, but as a stdout string and a list of displays, not their order (a
    display followed by a print came out print first). A callback attached here, as ipyparallel's
    own LoadBalancedView attaches its hook, sees every message in order.
    """
    client = view.client
    idents, targets = client._build_targets(view.targets)
    futures = [client.send_execute_request(view._socket, code, silent=False, ident=ident,
                                           metadata={"label": None, **(metadata or {})},
                                           message_future_hook=lambda f, i=i: on_future(i, f))
               for i, ident in enumerate(idents)]
    if isinstance(view.targets, int):
        futures = futures[0]
    return AsyncResult(client, futures, fname="execute", targets=targets, owner=True)


def ask_on_control(client, engine_id: int, msg_type: str, content: dict):
    """Send a request of ``msg_type`` to one engine on its control channel, which its own
    thread serves even while a cell runs; returns the future of its reply message (the client
    matches replies to requests by id, as it does for its own control requests)."""
    ident = client._engines[engine_id].encode()
    return client._send(client._control_stream, msg_type, content=content, ident=ident)
