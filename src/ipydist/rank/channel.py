"""The rank's one way to tell the notebook something outside a reply: an ipyparallel data
message on the rank's signed IOPub channel (no new port), tagged with the running cell's
request. The keys are in :mod:`ipydist.protocol`."""

from __future__ import annotations

import sys


def publish(key: str, value) -> None:
    """Send ``{key: value}`` to the notebook. Safe from any thread (ipykernel's IOPub thread
    does the sending). Does nothing off an engine (a plain script under mpiexec), nor before
    the engine's kernel is there.

    Not ipyparallel's ``publish_data``: it asks ``ZMQInteractiveShell.instance()``, which
    *makes* the shell when there is none yet. The vitals thread publishes from the rank's
    start on; when it did so before the engine made its kernel (a slow registration: clusters
    starting side by side), the kernel found that shell already there and it kept no kernel,
    and the start failed (``get_ipython().kernel`` None in ``attach``: issue 46)."""
    zmqshell = sys.modules.get("ipykernel.zmqshell")  # imported by the engine's kernel
    if zmqshell is None or not zmqshell.ZMQInteractiveShell.initialized():
        return
    try:
        shell = zmqshell.ZMQInteractiveShell.instance()
    except Exception:  # another kind of IPython shell holds the singleton: not an engine
        return
    if getattr(shell, "kernel", None) is None or getattr(shell, "data_pub", None) is None:
        return
    try:
        shell.data_pub.publish_data({key: value})
    except Exception:  # the engine is going away
        pass
