"""``python -m ipydist.rank [ipengine arguments]``: what mpiexec starts on every rank.

Where a fork server runs the rank (:mod:`ipydist.rank.start.forkserver`), this process only stands
in for it (:mod:`ipydist.rank.start.stub`), and what follows runs in the forked rank.

The heavy work (importing torch, pinning the GPU, the process-group rendezvous) happens in
:func:`~ipydist.rank.start.bootstrap.bootstrap` while the notebook side is still starting the
controller, so the first cell can run as soon as the engines register. Then the process
becomes an ordinary ipyparallel engine, given the remaining arguments unchanged.
"""

from ipydist.rank.start import stub

stub.run_rank_there()  # this host's fork server runs the rank, if there is one

from ipydist.rank.start.bootstrap import bootstrap  # noqa: E402

# First, before ipyparallel is even imported: the release watcher must block its signal before
# any other thread exists (threads inherit the mask).
bootstrap()

from ipydist.rank.progress import prefer_text_bars  # noqa: E402

prefer_text_bars()  # before the engine's kernel exists, or tqdm.auto picks a widget

from ipydist.rank import ending  # noqa: E402
from ipydist.rank.engine import RankEngine  # noqa: E402

ending.run_then_exit(RankEngine.launch_instance)  # without tearing the interpreter down
