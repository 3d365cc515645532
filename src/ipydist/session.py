"""The notebook-side Session: one ipyparallel cluster whose engines are MPI ranks.

``Session`` owns an ipyparallel ``Cluster`` (controller on loopback, engines started by
``mpiexec`` running :mod:`ipydist.engine`) and its ``Client``. The magics are a thin layer over
it, and it works the same from plain Python::

    with ipydist.Session(np=4) as s:
        s.run("import ipydist.torch as hvd; print(hvd.rank())")

The controller and the engines start at the same time: the engines import torch and build the
process group while the controller comes up, and then read its connection file. That is most
of why ``start()`` is quicker than a plain ``ipyparallel.Cluster`` followed by ``import torch``.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import time
import weakref

from ipydist import launch, processes, recovery, report, startup, watchdog
from ipydist.cell import CellRun, RunResult
from ipydist.errors import ClusterError, RankDied, RankError
from ipydist.live.history import MetricHistory
from ipydist.specs import SpecError, describe_ranks, format_ranks, parse_env, parse_ranks
from ipydist.stall import STALL_WARNING_SECONDS

DEFAULT_START_TIMEOUT = 120.0
#: When a rank fails, how long the others get to finish before they are released.
FAILURE_GRACE = 10.0


def _check_np(np) -> int:
    try:
        n = int(np)
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(np, bool) or n < 1 or str(np).strip() not in (str(n), f"+{n}"):
        raise SpecError(f"--np {np}: the number of ranks must be a whole number of at least 1.")
    return n


def _check_seconds(value, option: str, zero: bool = False) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds < 0 or (seconds == 0 and not zero) or seconds != seconds:
        off = ", or 0 to turn it off" if zero else ""
        shown = f"{value:g}" if isinstance(value, float) else value
        raise SpecError(f"{option} {shown}: expected a number of seconds above 0{off}.")
    return seconds


class Session:
    """N long-lived ranks under mpiexec, driven through ipyparallel, torch.distributed ready."""

    def __init__(
        self,
        np: int | None = None,
        gpus: str | list[int] = "auto",
        backend: str = "auto",
        mpi: str | None = None,
        mpi_args: str = "",
        timeout: float = DEFAULT_START_TIMEOUT,
        env: dict[str, str] | list[str] | None = None,
        init: bool = True,
        failure_grace: float = FAILURE_GRACE,
        stall_warning: float = STALL_WARNING_SECONDS,
    ):
        self.np = _check_np(np if np is not None else launch.default_np())
        self.gpus = launch.parse_gpus(gpus)
        if backend not in ("auto", "nccl", "gloo", "mpi"):
            raise SpecError(f"--backend {backend}: expected auto, nccl or gloo.")
        self.backend = backend
        self.mpi = mpi
        self.mpi_args = mpi_args or ""
        self.timeout = _check_seconds(timeout, "--timeout")
        self.env = parse_env(env)
        self.init = init
        #: When a rank fails, the seconds the others get to finish before they are released.
        self.failure_grace = float(failure_grace)
        #: Warn when a rank has waited this long in a collective that others have not entered
        #: (0: never).
        self.stall_warning = _check_seconds(stall_warning, "--stall-warning", zero=True)
        self.ranks: list[dict] = []
        #: Every point the ranks sent with ``hvd.log()``, in order (kept across restarts).
        self.metrics = MetricHistory()
        self.startup_seconds: float | None = None
        self._cluster = None
        self._client = None
        self._views: dict[tuple[int, ...], object] = {}
        self._profile_dir: str | None = None
        self._watchdog = None  # (process, pipe write end): see ipydist.watchdog
        self._rank_procs: list = []  # psutil processes of the ranks on this host

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def start(self) -> Session:
        """Start the ranks and wait until every one can run a cell; show a table of them."""
        if self.running:
            raise ClusterError(
                f"a cluster of {self.size} ranks is already running; %dist_stop it first "
                "(or %dist_restart)."
            )
        t0 = time.perf_counter()
        mpiexec = launch.find_mpiexec(self.mpi)
        rank_env = {
            "IPYDIST_GPUS": launch.format_gpus(self.gpus),
            "IPYDIST_BACKEND": self.backend,
            "IPYDIST_INIT": "1" if self.init else "0",
            **self.env,
        }
        plan = launch.plan_mpiexec(mpiexec, self.np, self.mpi_args, rank_env)
        for note in plan.notes:
            print(note, file=sys.stderr)
        progress = report.Progress()
        progress.update(f"Starting {self.np} ranks with {plan.flavor} mpiexec...")
        try:
            startup.launch_cluster(self, plan)
            self._watchdog = watchdog.start(self._all_pids())
            atexit.register(_stop_at_exit, weakref.ref(self))
            startup.wait_for_ranks(self, plan, progress, deadline=t0 + self.timeout)
        except BaseException:
            progress.close()
            self.stop(quiet=True)
            raise
        progress.close()
        self.startup_seconds = time.perf_counter() - t0
        report.show(self._ranks_table())
        return self

    def dead_ranks(self) -> list[dict]:
        """The ranks whose process is gone (ranks on this host; the heartbeat covers others)."""
        if len(self._rank_procs) != len(self.ranks):  # looked up once per cluster
            self._rank_procs = [processes.local_process(info) for info in self.ranks]
        return [info for info, proc in zip(self.ranks, self._rank_procs)
                if proc is not None and not processes.alive(proc)]

    def death_report(self) -> str:
        """Which rank died and how, for the cell's error; empty when every rank is alive."""
        if not self.dead_ranks():
            return ""
        output = startup.mpiexec_output(self, wait_for_exit=2.0)
        return launch.describe_death(output, self.dead_ranks())

    def stop(self, quiet: bool = False) -> None:
        """Stop engines, mpiexec and the controller, and make sure none of them is left."""
        pids = self._all_pids()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        if self._cluster is not None:
            try:
                self._cluster.stop_cluster_sync()
            except Exception as e:  # carry on: the pid sweep below still ends the processes
                if not quiet:
                    print(f"ipydist: stopping the cluster: {e}", file=sys.stderr)
        processes.reap(pids)
        if self._watchdog is not None:
            proc, pipe = self._watchdog
            os.close(pipe)  # the watchdog finds nothing left to end, and exits
            try:
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
            self._watchdog = None
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        was = len(self.ranks)
        self._cluster = self._client = self._profile_dir = None
        self._views = {}
        self._rank_procs = []
        self.ranks = []
        if was and not quiet:
            print(f"Stopped {was} ranks.")

    def restart(self) -> Session:
        """Stop, then start a fresh cluster with the same arguments."""
        self.stop(quiet=True)
        return self.start()

    def _all_pids(self) -> list[int]:
        pids = [p for info in self.ranks for p in (info["pid"], info.get("nanny_pid")) if p]
        if self._cluster is not None:
            for launcher in [self._cluster.controller, *self._cluster.engines.values()]:
                if launcher is not None and getattr(launcher, "pid", -1) > 0:
                    pids.append(launcher.pid)
        return pids

    def __enter__(self) -> Session:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(quiet=True)

    def __del__(self):
        if getattr(self, "_cluster", None) is not None:
            self.stop(quiet=True)

    def _require_running(self, alive: bool = True):
        """Raise unless a cluster runs (and, with ``alive``, every rank of it is there)."""
        if not self.running:
            raise ClusterError("no cluster is running: start one with %dist_start --np N.")
        if alive and (report := self.death_report()):
            raise RankDied(report)

    # --- cells -------------------------------------------------------------------------------

    def run(
        self,
        code: str,
        ranks: str | list[int] | None = None,
        timeout: float | None = None,
        output: str = "all",
    ) -> RunResult:
        """Run ``code`` on the ranks (all by default), streaming their output as it comes.

        Raises :class:`RankError` naming the ranks that raised, with the first one's traceback.
        """
        self._require_running(alive=False)  # the cell's wait loop checks the ranks
        targets = parse_ranks(ranks, self.size)
        if output not in ("all", "rank0"):
            raise SpecError(f"--output {output}: expected all or rank0.")
        _check_syntax(code)
        started = time.perf_counter()
        ar = self._view(targets).execute(code, silent=False, block=False)
        return CellRun(self, ar, targets, output, timeout, started).wait()

    def _view(self, targets: list[int]):
        """One DirectView per set of targets, reused: making one costs more than a small cell."""
        key = tuple(targets)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._client[list(targets)]
        return view

    def release(self, ranks: list[int]) -> None:
        """Get ``ranks`` out of what they run, collectives included (see ipydist.recovery)."""
        recovery.release(self, ranks)

    def recover(self, released: list[int]) -> list[str]:
        """After a failed cell: rebuild the process group where needed; lines for the message."""
        return recovery.recover(self, released)

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        """Send ``sig`` to ranks: directly to local pids, through ipyparallel's nanny otherwise."""
        self._require_running(alive=False)
        remote = []
        for r in parse_ranks(ranks, self.size):
            proc = processes.local_process(self.ranks[r])
            if proc is None:
                remote.append(r)
            elif processes.alive(proc):
                proc.send_signal(sig)
        if remote:
            self._client.send_signal(sig, targets=remote, block=False)

    # --- variables ---------------------------------------------------------------------------

    def pull(self, name: str, rank: int | None = None):
        """The value of ``name`` on every rank (a list in rank order), or on one rank."""
        self._require_running()
        targets = parse_ranks(rank, self.size)
        replies = self._view(targets).pull(name, block=False).get(return_exceptions=True)
        failures = {r: v for r, v in zip(targets, replies) if isinstance(v, Exception)}
        if failures:
            first = next(iter(failures.values()))
            if first.ename == "NameError":
                raise NameError(
                    f"{name!r} is not defined on {describe_ranks(failures)}: "
                    "set it in an %%everyrank cell first."
                )
            raise RankError(failures, what=f"pull({name!r})")
        return replies[0] if rank is not None else replies

    def push(self, **values) -> None:
        """Send notebook values to every rank, under the given names."""
        self._require_running()
        self._view(list(range(self.size))).push(values, block=True)

    # --- status ------------------------------------------------------------------------------

    def status(self) -> report.Table:
        """One row per rank: host, pid, device, alive/busy/dead, memory."""
        self._require_running(alive=False)
        registered = set(self._client.ids)
        rows = []
        for info in self.ranks:
            r = info["rank"]
            proc = processes.local_process(info)
            alive = r in registered and (proc is None or processes.alive(proc))
            busy = alive and self._has_pending_requests(r)
            memory = ""
            if proc is not None and processes.alive(proc):
                memory = f"{proc.memory_info().rss / 2**20:.0f} MiB"
            state = "dead" if not alive else ("busy" if busy else "idle")
            rows.append([r, info["host"], info["pid"], info["device"], state, memory])
        dead = [row[0] for row in rows if row[4] == "dead"]
        caption = f"{self.size} ranks" + (f"; {describe_ranks(dead)} dead" if dead else "")
        return report.Table(["rank", "host", "pid", "device", "state", "memory"], rows, caption)

    def _has_pending_requests(self, rank: int) -> bool:
        """Whether a request of ours is still running or queued on ``rank``.

        Asked of our own client, which knows the moment a reply arrives; the controller's
        queue_status() learns it a little later, so right after a cell it can still say busy.
        """
        uuid = self._client._engines.get(rank)
        return bool(uuid and self._client._outstanding_dict.get(uuid))

    def _ranks_table(self) -> report.Table:
        rows = [[i["rank"], i["host"], i["pid"], i["device"], i["backend"]] for i in self.ranks]
        backend = self.ranks[0]["backend"] if self.ranks else "?"
        caption = (
            f"{self.size} ranks ready in {self.startup_seconds:.1f} s "
            f"(backend {backend}, ranks {format_ranks(range(self.size))})"
        )
        return report.Table(["rank", "host", "pid", "device", "backend"], rows, caption)


def _stop_at_exit(ref) -> None:
    """The kernel is exiting (shutdown, restart, end of a script): stop the cluster first."""
    session = ref()
    if session is not None and session.running:
        session.stop(quiet=True)


@functools.cache
def _transformer():
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


@functools.lru_cache(maxsize=256)
def _check_syntax(code: str) -> None:
    """Raise SyntaxError here, before the cell reaches any rank (IPython syntax allowed).

    Cached by source: a cell run again (a training loop re-run after a change elsewhere) is
    not parsed again. A cell that raised is not cached, so it is reported every time.
    """
    compile(_transformer().transform_cell(code), "<everyrank cell>", "exec")

