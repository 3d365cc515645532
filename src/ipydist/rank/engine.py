"""The engine a rank runs: ipyparallel's, ending cleanly when it is asked to, and starting
from a connection file only when it is whole.

A SIGTERM is how a rank is asked to end (ipydist's stop sends it, mpiexec and Slurm forward
it). ipyparallel's engine then stops its event loop under the ``run_sync`` of its ``start``,
and tornado raises "Event loop stopped before Future completed.": the rank printed that
traceback and ended with exit code 1, and mpiexec, seeing a rank fail, ended the others half
a second later, cutting short their own ending (their MPI finalize) and making a stop 0.5 s
longer. Here an end that was asked for is a clean end, with exit code 0; any other error
still escapes.
"""

from __future__ import annotations

import json
import time

from ipyparallel.engine.app import IPEngine
from traitlets import default

from ipydist.rank.start import bootstrap

#: How often a rank looks again at a connection file the controller is still writing.
WHOLE_FILE_POLL_SECONDS = 0.02


class RankEngine(IPEngine):
    """ipyparallel's engine, whose SIGTERM ends it with exit code 0, and which reads its
    connection file only once the controller has written all of it."""

    _stop_asked = False

    @default("id")
    def _id_default(self):
        """A rank started with the job asks for its rank as its engine id (the notebook checks
        that they match). A rank that joined later (a spawned replacement, a hot spare) asks
        for none, and the controller gives it one never used: the id of its number may be
        the engine of the rank it replaces, or of one that left, which the notebook counts as
        known until the controller drops it, so a new engine under that id went unseen and
        a grow waited out its 60 s (1 of 2 new ranks registered)."""
        if bootstrap.joined_late:
            return None
        from ipydist.torch._core import topology

        rt = topology.get()
        return rt.rank if rt is not None else None

    def load_connection_file(self):
        """ipyparallel's engine waits for the file to exist, then reads it, and the controller
        writes it in place (``open``, then ``write``): under load a rank read it empty and
        failed its start ("Expecting value: line 1 column 1"). Read it once it is whole, for
        as long as the engine waits for it to exist."""
        if not self.connection_info_env:
            _wait_until_whole(self.url_file, self.wait_for_url_file)
        super().load_connection_file()

    def _signal_stop(self, sig, frame):
        self._stop_asked = True
        super()._signal_stop(sig, frame)

    def start(self):
        try:
            super().start()
        except RuntimeError:
            if not self._stop_asked:
                raise


def _wait_until_whole(path: str, seconds: float) -> None:
    """Until ``path`` holds a whole JSON document, or ``seconds`` have passed (the engine's own
    read then says what is wrong with it)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with open(path) as f:
                json.load(f)
            return
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return
        time.sleep(WHOLE_FILE_POLL_SECONDS)
