"""How messages name the user's next step: in magics inside a notebook, in ``Session`` calls from
plain Python. The magics give their session :data:`MAGICS`; a ``Session`` made in Python code
speaks :data:`PYTHON`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Words:
    start: str
    stop: str
    restart: str
    #: where code runs on every rank
    cell: str
    #: how a cell is interrupted after S seconds
    timeout: str
    #: how the cluster is grown or shrunk to N ranks
    scale: str = "%dist_scale --np N"
    #: how every rank's stack is shown, and how a rank's last error is debugged
    stack: str = "%dist_stack"
    debug: str = "%dist_debug --rank R"

    def no_cluster(self) -> str:
        return f"no cluster is running: start one with {self.start}."

    def already_running(self, size: int) -> str:
        return (f"a cluster of {size} ranks is already running; stop it first with {self.stop}, "
                f"or use {self.restart}.")


MAGICS = Words(start="%dist_start --np N", stop="%dist_stop", restart="%dist_restart",
               cell="an %%everyrank cell", timeout="%%everyrank --timeout S")
PYTHON = Words(start="Session(np=N).start()", stop="Session.stop()",
               restart="Session.restart()", cell="code passed to Session.run()",
               timeout="Session.run(code, timeout=S)", scale="Session.scale(np=N)",
               stack="Session.stacks()", debug="Session.debug(rank, commands)")
