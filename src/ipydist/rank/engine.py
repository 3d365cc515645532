"""The engine a rank runs: ipyparallel's, ending cleanly when it is asked to.

A SIGTERM is how a rank is asked to end (ipydist's stop sends it, mpiexec and Slurm forward
it). ipyparallel's engine then stops its event loop under the ``run_sync`` of its ``start``,
and tornado raises "Event loop stopped before Future completed.": the rank printed that
traceback and ended with exit code 1, and mpiexec, seeing a rank fail, ended the others half
a second later, cutting short their own ending (their MPI finalize) and making a stop 0.5 s
longer. Here an end that was asked for is a clean end, with exit code 0; any other error
still escapes.
"""

from __future__ import annotations

from ipyparallel.engine.app import IPEngine


class RankEngine(IPEngine):
    """ipyparallel's engine, whose SIGTERM ends it with exit code 0."""

    _stop_asked = False

    def _signal_stop(self, sig, frame):
        self._stop_asked = True
        super()._signal_stop(sig, frame)

    def start(self):
        try:
            super().start()
        except RuntimeError:
            if not self._stop_asked:
                raise
