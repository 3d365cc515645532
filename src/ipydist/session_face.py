"""What the notebook side may use of the :class:`~ipydist.session.Session` that drives it, and
of the magics, declared as two protocols: the cell loop, the live views, the side panel, the
debugger and completion are handed a session (or the magics) typed by these, so the type check
holds them to this narrow face, and nothing on the notebook side imports ``session`` or
``magics`` back (the Session and DistMagics satisfy the protocols; mypy checks where they are
handed over)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: these modules are handed a session, they do not make one
    from ipydist.notebook.cluster import Cluster
    from ipydist.notebook.failures.healing import Heal
    from ipydist.notebook.live.cluster_view import ClusterMonitor
    from ipydist.notebook.live.history import MetricHistory
    from ipydist.notebook.words import Words
    from ipydist.specs import StartOptions


class SessionFace(Protocol):
    """The session as the notebook side sees it."""

    #: How messages name the user's next step (magics or Python).
    words: Words
    #: The start options (the cell loop reads the stall warning and the failure grace).
    options: StartOptions
    #: The running cluster, None when stopped.
    cluster: Cluster | None
    #: The ranks whose code raised in the last cell (the debugger's default).
    failed_ranks: list[int]
    #: The number the ranks gave the last cell they ran.
    last_cell_number: int
    #: Every point logged with ``hvd.log()``; the live views' state.
    metrics: MetricHistory
    monitor: ClusterMonitor
    #: A heal under way (``--elastic``), None otherwise: the live views say where it is.
    healing: Heal | None

    @property
    def running(self) -> bool: ...

    @property
    def size(self) -> int: ...

    @property
    def elastic(self) -> bool: ...

    def death_report(self) -> str:
        """Which rank died and how; empty when every rank is alive."""
        ...

    def stop(self, quiet: bool = False) -> None: ...

    def restart(self) -> object: ...


class MagicsFace(Protocol):
    """The magics as completion and the side panel see them: the session, if any (read at
    every use, since a cluster may stop and start again), and the cell mode."""

    session: SessionFace | None
    #: "everyrank" while ``%dist_mode everyrank`` sends every cell to the ranks.
    mode: str
