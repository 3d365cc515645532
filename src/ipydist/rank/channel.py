"""The rank's one way to tell the notebook something outside a reply: an ipyparallel data
message on the rank's signed IOPub channel (no new port), tagged with the running cell's
request. The keys are in :mod:`ipydist.protocol`."""

from __future__ import annotations


def publish(key: str, value) -> None:
    """Send ``{key: value}`` to the notebook. Safe from any thread (ipykernel's IOPub thread
    does the sending). Does nothing off an engine (a plain script under mpiexec)."""
    try:
        from ipyparallel.datapub import publish_data

        publish_data({key: value})
    except Exception:  # not on an engine
        pass
