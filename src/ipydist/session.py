"""``Session``: N long-lived ranks under mpiexec, driven through ipyparallel, in Python.

The magics are a thin layer over it, and it works the same from plain Python::

    with ipydist.Session(np=4) as s:
        s.run("import ipydist.torch as hvd; print(hvd.rank())")

A session validates what the user asked for, plans mpiexec's command line, and hands the
processes to a :class:`~ipydist.notebook.cluster.Cluster`, which it replaces on
:meth:`Session.restart`. What it keeps across restarts is what the user made: the arguments and
the metrics history.
"""

from __future__ import annotations

import atexit
import inspect
import sys
import time
import weakref
from dataclasses import fields

from ipydist import protocol
from ipydist.errors import ClusterError, NotDefined, RankDied, RankError
from ipydist.notebook import words
from ipydist.notebook.cell import CellRun, RunResult
from ipydist.notebook.cell_checks import check_syntax, wait_until_idle
from ipydist.notebook.cluster import CONTROLLER_LOST_NOTE, Cluster
from ipydist.notebook.failures import healing, recovery
from ipydist.notebook.introspection import debugging
from ipydist.notebook.launch import deaths, local_gpus, processes
from ipydist.notebook.launch.planning import plan_launch
from ipydist.notebook.live import cluster_view
from ipydist.notebook.live.cluster_view import ClusterMonitor, ClusterView
from ipydist.notebook.live.history import MetricHistory
from ipydist.notebook.output import display
from ipydist.notebook.reports import timeline
from ipydist.notebook.reports.status import cluster_status, start_table
from ipydist.specs import (
    SpecError,
    StartOptions,
    default_of,
    describe_ranks,
    parse_np,
    parse_ranks,
)

#: How long ``%dist_timeline`` waits for the ranks (a rank busy with a cell answers once the
#: cell ends).
TIMELINE_TIMEOUT = 30.0


class Session:
    """N long-lived ranks under mpiexec, driven through ipyparallel, torch.distributed ready.

    ``Session(np=4, gpus="none", ...)`` takes the options of ``%dist_start`` as keywords,
    each a field of :class:`~ipydist.specs.StartOptions` (``Session(options)`` takes them
    whole); ``Session?`` lists them with their defaults. Messages name the next step in Python
    (``Session.start()``); the magics set :attr:`words` so that theirs name magics
    (``%dist_start``).
    """

    def __init__(self, options: StartOptions | None = None, /, **given):
        #: What the user asked for (``%dist_start``'s options), checked; a restart starts
        #: with them again, and ``scale()`` changes ``np`` in them.
        self.options = (options or StartOptions()).changed(**given)
        #: Every point the ranks sent with ``hvd.log()``, in order (kept across restarts).
        self.metrics = MetricHistory()
        #: What the live cluster views show (``%dist_status --live``).
        self.monitor = ClusterMonitor(self)
        #: How messages name the user's next step (see :mod:`ipydist.notebook.words`).
        self.words = words.PYTHON
        self.startup_seconds: float | None = None
        #: The running cluster (None when stopped): its processes, client and ranks.
        self.cluster: Cluster | None = None
        self.healing: healing.Heal | None = None  # a heal under way
        #: The ranks whose code raised in the last cell (``debug()``'s default is the lowest).
        self.failed_ranks: list[int] = []
        #: The number the ranks gave the last cell they ran (``notebook.cell``).
        self.last_cell_number = 0
        self._stop_at_exit_registered = False

    def __setattr__(self, name: str, value) -> None:
        """A start option set on the session would be ignored (the session reads
        ``self.options``): refused, saying how to change it."""
        if name in _OPTION_NAMES:
            raise AttributeError(
                f"{name} is a start option, kept in session.options: pass it when making the "
                f"session (Session({name}=...)), or change it with session.options = "
                f"session.options.changed({name}=...).")
        super().__setattr__(name, value)

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.cluster is not None and self.cluster.client is not None

    @property
    def client(self):
        """ipyparallel's ``Client`` of the running cluster, for what ipydist does not wrap:
        engine ``i`` is rank ``i`` (``s.client[:]`` is a DirectView of every rank). Code sent
        through it bypasses ipydist's failure handling: a rank that raises is not released,
        and a collective one rank never calls hangs the others."""
        return self._require_running(alive=False).client

    @property
    def ranks(self) -> list[dict]:
        """One dict per rank, in rank order: rank, host, pid, device, backend, ... (the
        fields of :class:`~ipydist.protocol.RankInfo`)."""
        return [info.as_dict() for info in self.cluster.ranks] if self.cluster is not None \
            else []

    @property
    def size(self) -> int:
        return self.cluster.size if self.cluster is not None else 0

    @property
    def np(self) -> int | None:
        """The ranks the cluster has; before it starts, ``np`` as asked (None: decided at
        start, from the hosts, the allocation, the GPUs or the cores)."""
        return self.size if self.running else self.options.np

    @property
    def elastic(self) -> bool:
        """Whether the running cluster's ranks outlive one that dies (decided at start: see
        the ``elastic`` option)."""
        return self.cluster is not None and self.cluster.plan.elastic

    def start(self) -> Session:
        """Start the ranks and wait until every one can run a cell; show a table of them."""
        if self.running:
            raise ClusterError(self.words.already_running(self.size))
        t0 = time.perf_counter()
        options = self.options
        plan = plan_launch(options)
        if not plan.multi_host:
            local_gpus.check_gpus_here(options.gpus, options.backend, plan.np,
                                       options.gpus_per_rank)
        for note in plan.notes:  # information, not a warning: no red stderr block
            print(note)
        if not self._stop_at_exit_registered:
            atexit.register(_stop_at_exit, weakref.ref(self))
            self._stop_at_exit_registered = True
        for attempt in (1, 2):
            progress = display.Progress()
            cluster = self.cluster = Cluster(plan, options.timeout)
            try:
                cluster.start(progress, started=t0)
                break
            except BaseException as e:
                progress.close()
                crashed = deaths.crashed_in_mpi_init(_launch_output(cluster))
                again = (attempt == 1 and isinstance(e, ClusterError)
                         and (crashed or cluster.controller_lost))
                self.stop(quiet=True)
                if not again:
                    raise
                print(deaths.CRASHED_IN_MPI_INIT_NOTE if crashed else CONTROLLER_LOST_NOTE)
                t0 = time.perf_counter()
        steps = cluster.startup.breakdown() if cluster.startup is not None else ""
        steps_shown = progress.close(steps)
        self.metrics.new_cluster()  # its ranks number their metric batches from 0
        self.startup_seconds = time.perf_counter() - t0
        display.show(start_table(cluster.ranks, self.startup_seconds, cluster.spare_pids))
        if display.in_kernel():  # the live view under it, collapsed: a click opens it
            cluster_view.show(self.monitor.open_view(collapsed=True))
        if steps and not steps_shown:
            print(steps)  # below the table: a caption would wrap
        if cluster.plan.route is not None:
            hosts = len({info.host for info in cluster.ranks})
            print(f"{hosts} hosts; the controller listens on {cluster.plan.route}, the "
                  "address that reaches them")
        return self

    def death_report(self) -> str:
        """Which rank died and how, for the cell's error; empty when every rank is alive."""
        cluster = self.cluster
        dead = cluster.dead_ranks() if cluster is not None else []
        if cluster is None or not dead:
            return ""
        # mpiexec ends the job, saying what ended the rank as it goes (unless --elastic heals)
        if self.can_heal:  # the job lives on: the cause is in the daemons' log, a moment later
            output = deaths.output_with_ends(cluster.launcher_output, dead, processes.is_here)
        else:
            cluster.end_job_after_a_death(dead)
            output = cluster.launcher_output(wait_for_exit=2.0)
        return deaths.describe_death(output, cluster.dead_ranks(), self.words.restart,
                                      cluster.plan.command_name, healing=self.can_heal,
                                      first=cluster.first_dead)

    def scale(self, np: int) -> None:
        """Grow or shrink the running ``--elastic`` cluster to ``np`` ranks, keeping every
        rank's state (see :func:`ipydist.notebook.failures.healing.scale`)."""
        cluster = self._require_running()
        np = parse_np(np)
        if not self.elastic:
            raise SpecError("scaling needs an elastic cluster, which keeps the job when ranks "
                            f"leave, and this one is not: stop it ({self.words.stop}) and start "
                            "one with --elastic (Open MPI's fault tolerance; the default across "
                            "hosts).")
        if np != self.size:
            print(f"ipydist: {healing.scale(cluster, np)}", file=sys.stderr, flush=True)
            self.options = self.options.changed(np=np)  # a restart starts as many

    @property
    def can_heal(self) -> bool:
        """``--elastic``, and mpiexec kept the job (it ends it when it loses a host)."""
        return (self.cluster is not None and self.elastic
                and processes.alive(self.cluster.launcher_process()))

    def start_heal(self) -> None:
        """``--elastic``: replace the ranks found dead (in a thread; see :meth:`healed`)."""
        cluster = self.cluster
        dead = [info.rank for info in cluster.dead_ranks()] if cluster is not None else []
        if cluster is not None and dead and self.healing is None and self.can_heal:
            self.healing = healing.Heal(cluster, dead, self.words, self.options.min_np).start()

    def healed(self) -> None:
        """Wait for a heal under way, and say what it did (or raise, if it failed)."""
        heal, self.healing = self.healing, None
        if heal is None:
            return
        lines = heal.wait()
        if heal.failed:
            raise ClusterError(" ".join(lines))
        for line in lines:
            print(f"ipydist: {line}", file=sys.stderr, flush=True)

    def stop(self, quiet: bool = False) -> None:
        """Stop engines, mpiexec and the controller, and make sure none of them is left."""
        cluster, self.cluster = self.cluster, None
        self.healing = None  # a heal under way ends with the cluster
        if cluster is None:
            return
        was = cluster.size
        cluster.stop(quiet)
        if was and not quiet:
            print(f"Stopped {was} ranks.")

    def restart(self) -> Session:
        """Stop, then start a fresh cluster with the same arguments."""
        self.stop(quiet=True)
        return self.start()

    def __enter__(self) -> Session:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(quiet=True)

    def __del__(self):
        if getattr(self, "cluster", None) is not None:
            self.stop(quiet=True)

    def _require_running(self, alive: bool = True) -> Cluster:
        """The cluster; raise unless one runs (and, with ``alive``, every rank of it is there)."""
        if not self.running:
            raise ClusterError(self.words.no_cluster())
        self.healed()
        if (alive or self.elastic) and (report := self.death_report()):
            if not self.can_heal:
                raise RankDied(report)
            print(f"ipydist: {report}", file=sys.stderr, flush=True)
            self.start_heal()
            self.healed()
        if self.cluster is None:  # stopped while it healed
            raise ClusterError(self.words.no_cluster())
        if refusal := self.cluster.refusal(self.words.restart):
            raise ClusterError(refusal)
        return self.cluster

    # --- cells -------------------------------------------------------------------------------

    def run(
        self,
        code: str,
        ranks: str | list[int] | None = None,
        timeout: float | None = None,
        output: str = "all",
        debug_ranks: str | list[int] | None = None,
    ) -> RunResult:
        """Run ``code`` on the ranks (all by default), streaming their output as it comes.
        ``breakpoint()`` stops at a pdb prompt on ``debug_ranks`` (default: all), one rank at
        a time, where a person can type; elsewhere it is ignored, with a line saying so.

        Raises :class:`RankError` naming the ranks that raised, with the first one's traceback.
        """
        cluster = self._require_running(alive=False)  # the cell's wait loop checks the ranks
        targets = parse_ranks(ranks, self.size)
        if output not in ("all", "rank0"):
            raise SpecError(f"--output {output}: expected all or rank0.")
        check_syntax(code)
        waits_for = list(range(self.size)) if cluster.recovery_owed is not None else targets
        if cluster.busy_ranks(waits_for):
            if report := self.death_report():  # a dead rank never answers: say that instead
                raise RankDied(report)
            wait_until_idle(cluster, waits_for, self.words.restart)
        if cluster.recovery_owed is not None:  # the last cell ended before every rank stopped
            notes = recovery.recover(cluster, cluster.recovery_owed, self.words.restart)
            cluster.recovery_owed = None  # still owed after a Ctrl-C in the middle of it
            for note in notes:
                print(f"ipydist: before this cell: {note}", file=sys.stderr, flush=True)
        stopping = None if debug_ranks is None else parse_ranks(debug_ranks, self.size)
        started = time.perf_counter()
        self.failed_ranks = []
        try:
            return CellRun(self, code, targets, output, timeout, started, stopping).wait()
        except RankError as e:
            self.failed_ranks = [r for r in e.failures if r not in e.released] or list(e.failures)
            raise
        except RankDied:
            if self.elastic:
                self.start_heal()
            raise

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        """Send ``sig`` to ranks: directly to local pids, through ipyparallel's nanny otherwise."""
        self._require_running(alive=False).signal(sig, ranks)

    def debug(self, rank: int | None = None, commands: list[str] | None = None) -> str:
        """pdb on ``rank``'s last error (default: the lowest rank that raised in the last
        cell): at a prompt, or running ``commands`` then ``q``; the rank is left as it was.
        Returns what pdb printed. Where nobody can type, prints the frames with their
        variables instead."""
        return debugging.debug_rank(self, self._require_running(), rank, commands)

    def stacks(self, ranks: str | list[int] | None = None) -> debugging.Stacks:
        """Where each rank is now, asked while its cell runs (collapsed where ranks agree)."""
        cluster = self._require_running(alive=False)
        return debugging.Stacks(debugging.stacks(cluster, parse_ranks(ranks, self.size)))

    # --- variables ---------------------------------------------------------------------------

    def pull(self, name: str, rank: int | None = None):
        """The value of ``name`` on every rank (a list in rank order), or on one rank."""
        cluster = self._require_running()
        targets = parse_ranks(rank, self.size)
        replies = cluster.view(targets).pull(name, block=False).get(return_exceptions=True)
        failures = {r: v for r, v in zip(targets, replies) if isinstance(v, Exception)}
        if failures:
            first = next(iter(failures.values()))
            # ipyparallel's own errors (a rank that died: EngineError) have no ename
            if getattr(first, "ename", None) == "NameError":
                raise NotDefined(
                    f"{name!r} is not defined on {describe_ranks(failures)}: "
                    f"set it in {self.words.cell} first."
                )
            raise RankError(failures, what=f"pull({name!r})")
        return replies[0] if rank is not None else replies

    def push(self, **values) -> None:
        """Send notebook values to every rank, under the given names."""
        self._require_running().view(list(range(self.size))).push(values, block=True)

    # --- timeline ----------------------------------------------------------------------------

    def timeline(self, action: str = "show",
                 path: str = protocol.TIMELINE_FILE) -> timeline.Timeline:
        """Every rank's recorded collectives (``action``: "start" recording afresh, "show"
        what was recorded so far, or "stop" and show), written as one Chrome trace at
        ``path`` unless there is nothing to write."""
        cluster = self._require_running()
        rank_action = {"start": "start", "show": "events", "stop": "stop"}[action]
        per_rank = cluster.call(protocol.TIMELINE, rank_action, timeout=TIMELINE_TIMEOUT)
        if action == "start":
            return timeline.Timeline([[] for _ in range(self.size)])
        events = [r or [] for r in per_rank]  # "events" and "stop" reply a list
        shown = timeline.Timeline(events)
        if not shown.empty:
            shown.path = timeline.save(events, path)
        return shown

    # --- status ------------------------------------------------------------------------------

    def status(self) -> display.Table:
        """One row per rank: host, pid, device, state, memory. After a death, which rank died
        first and how, the others as stopped by mpiexec, and what to do next; while a heal
        runs, how far it is (the copy of rank 0's state: MB sent of how many)."""
        heal = self.healing
        if heal is not None and not heal.done and self.cluster is not None:
            # a heal under way: how far it is, not a wait for it (the next cell waits)
            return cluster_status(self.cluster, self.words.restart, healing=heal.describe())
        cluster = self.cluster
        if cluster is not None and (refusal := cluster.refusal(self.words.restart)):
            table = cluster_status(cluster, self.words.restart)  # what it is, not a refusal
            table.note = refusal
            return table
        return cluster_status(self._require_running(alive=False), self.words.restart)


    def live_status(self) -> ClusterView:
        """A view of every rank that updates about once a second while it is shown (a
        widget: what each rank does, CPU, memory, GPU, step time; interrupt, restart and stop
        buttons). See :mod:`ipydist.notebook.live.cluster_view`."""
        self._require_running(alive=False)
        return self.monitor.open_view()


#: The start options' names, which :meth:`Session.__setattr__` refuses.
_OPTION_NAMES = frozenset(option.name for option in fields(StartOptions))


def _signature_of_options(init):
    """``Session.__init__``'s signature as ``Session?`` and ``inspect`` show it: every start
    option, by keyword, with its default (the declaration is :class:`StartOptions`'s)."""
    self, options, _ = inspect.signature(init).parameters.values()
    keywords = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY,
                                  default=default_of(o), annotation=o.type)
                for o in fields(StartOptions)]
    return inspect.Signature([self, options, *keywords])


Session.__init__.__signature__ = (  # type: ignore[attr-defined] # inspect reads it
    _signature_of_options(Session.__init__))


def _launch_output(cluster: Cluster) -> str:
    """What the launcher of a start that failed printed ("" where none was started)."""
    try:
        return cluster.launcher_output()
    except Exception:
        return ""


def _stop_at_exit(ref) -> None:
    """The kernel is exiting (shutdown, restart, end of a script): stop the cluster first."""
    session = ref()
    if session is not None and session.running:
        session.stop(quiet=True)
