"""ipydist: train PyTorch models on many GPUs (or CPU processes) from a Jupyter notebook.

In a notebook::

    %load_ext ipydist
    %dist_start --np 4

From Python: ``ipydist.Session(np=4)``. Inside cells: ``import ipydist.torch as hvd``.
The notebook-side names are imported lazily so that ranks, which import ``ipydist.torch``,
do not pay for IPython's magics machinery.
"""

from typing import TYPE_CHECKING

from ipydist._version import __version__
from ipydist.error_base import IpydistError

if TYPE_CHECKING:
    from ipydist.session import Session
    from ipydist.specs import StartOptions

__all__ = [
    "IpydistError", "Session", "StartOptions", "__version__", "load_ipython_extension",
    "magics_session", "metrics", "unload_ipython_extension",
]


def __getattr__(name: str):
    # Lazily too: every process of a cluster imports this package, a rank's stub first
    # (``python -m ipydist.rank``), which needs neither (StartOptions' module cost it 0.07 s).
    if name == "Session":
        from ipydist.session import Session

        return Session
    if name == "StartOptions":
        from ipydist.specs import StartOptions

        return StartOptions
    raise AttributeError(f"module 'ipydist' has no attribute {name!r}")


def magics_session():
    """The :class:`Session` the magics drive in this notebook (``%dist_start``'s), or None
    before ``%load_ext ipydist``: its methods and ``client`` from Python. (Not ``session``:
    that is the module :class:`Session` is defined in.)"""
    from IPython import get_ipython

    shell = get_ipython()
    magics = shell.magics_manager.registry.get("DistMagics") if shell is not None else None
    return getattr(magics, "session", None)


def metrics(ranks: bool = False, session=None):
    """Every point rank 0 logged with ``hvd.log()`` in this notebook, in order, across restarts:
    in the cluster the magics started, or in ``session`` (a :class:`Session` made in Python).

    A pandas DataFrame when pandas is installed (columns ``step``, ``time`` -- a UTC
    datetime --, ``cluster`` -- 1 for the session's first cluster, 2 after a restart, ... --,
    ``cell`` -- the execution count of the cell that logged it --, then one per metric, NaN
    where a step did not log it); otherwise a list of dicts, each with only the metrics logged
    at that step (``time`` in seconds since the epoch). ``ranks=True`` (DataFrame only): every
    rank's points, with a ``rank`` column first -- the other ranks send theirs only when they
    log with ``reduce="none"``.
    """
    from ipydist.notebook.live.history import MetricHistory

    if session is None:
        session = magics_session()
    history = session.metrics if session is not None else MetricHistory()
    try:
        import pandas  # noqa: F401
    except ImportError:
        if ranks:
            message = "ipydist.metrics(ranks=True) needs pandas: pip install pandas"
            raise ImportError(message) from None
        return history.rows()
    return history.to_dataframe(ranks=ranks)


def load_ipython_extension(ipython) -> None:
    """``%load_ext ipydist``: register the magics, answer completion and help for code that
    runs on the ranks from rank 0, let JupyterLab's ipydist panel follow the cluster, and keep
    the last cells' output for a page that opens the notebook again."""
    from ipydist.magics import DistMagics
    from ipydist.notebook import reopen
    from ipydist.notebook.introspection import completion
    from ipydist.notebook.live import cluster_panel

    ipython.register_magics(DistMagics)
    magics = ipython.magics_manager.registry["DistMagics"]
    completion.install(ipython, magics)
    cluster_panel.register(ipython, magics)  # once per kernel, however often it is loaded
    reopen.install(ipython)  # the same


def _jupyter_labextension_paths() -> list[dict]:
    """Where the prebuilt JupyterLab extension (the ipydist side panel) is, for Jupyter's
    tools (``jupyter labextension develop``); the wheel installs it under
    ``share/jupyter/labextensions/ipydist``."""
    return [{"src": "labextension", "dest": "ipydist"}]


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext ipydist``: stop the cluster if one runs, so nothing is left behind."""
    magics = ipython.magics_manager.registry.get("DistMagics")
    if magics is not None and magics.session is not None:
        magics.session.stop(quiet=True)
