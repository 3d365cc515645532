"""One running cluster, and everything it started: the owner of every process handle.

:class:`Cluster` starts ipyparallel's controller and mpiexec's ranks at the same time (the
ranks import torch and build the process group while the controller comes up), then waits for
every rank to register while watching mpiexec, so that a launch that fails ends the wait at once
with MPI's own message instead of running into ``--timeout``; meanwhile a status line shows how
far the ranks got (:mod:`~ipydist.notebook.launch.startup`). It keeps the client, the
controller and mpiexec launchers, the ranks' pids, the watchdog and the profile folder, and
:meth:`Cluster.stop` ends all of them, as ipyparallel's own ``Cluster`` does for what it starts.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import replace
from typing import Any, TypeVar

from ipydist import protocol
from ipydist.errors import ClusterError, RankTimeout
from ipydist.notebook import ipp
from ipydist.notebook.failures import watchdog
from ipydist.notebook.launch import kept_forkserver, mpiexec, processes, slurm, startup
from ipydist.notebook.launch.plan import Plan
from ipydist.specs import describe_ranks, parse_ranks

#: Said when a start is tried again after its controller ended before the ranks registered.
#: ipyparallel's controller chooses its ports by binding port 0 and closing the socket, then
#: binds them again: in between, on a busy machine, another process may take one (a kernel
#: choosing its own ports the same way, or a connection's local port), and the controller
#: ends, or does not answer on that port. Its ranks would only see its heartbeats missing,
#: 35 s later; the notebook's client gives up after 10 s.
CONTROLLER_LOST_NOTE = ("ipydist: the ipyparallel controller ended or did not answer during the "
                        "start (a port it had chosen was likely taken before it bound it); "
                        "starting again, once.")

#: Controller heartbeat: a rank is declared gone after HEARTBEAT_MS * HEARTBEAT_MISSES ms.
#: On one host a rank's death is seen by its pid at once; on another, its nanny tells the
#: controller as soon as the rank's process ends (within milliseconds), and a lost host ends
#: mpiexec's job. So the heartbeat only backs those up, for a rank that hangs without
#: ending, and is lenient everywhere: across hosts it was 4 s, and on 2 loaded cores the
#: engines of ranks healthy but busy in MPI (spawning a replacement) went 9 to 18 s without
#: answering, were declared dead, and failed the heal (issue 46).
HEARTBEAT_MS = 200
HEARTBEAT_MISSES = 50
HEARTBEAT_MISSES_ACROSS_HOSTS = 100
#: How long a stop waits for healthy ranks to end by themselves (atexit callbacks run, files
#: left open flushed, MPI finalized: :mod:`ipydist.rank.ending`) before mpiexec is told to end
#: the job, which kills a rank still ending about half a second later: an atexit callback of
#: 0.8 s was cut short, and a file a cell left open came out empty on a loaded machine.
RANKS_END_SECONDS = 10.0


R = TypeVar("R")  # a rank call's reply


def profile_parent(plan: Plan) -> str | None:
    """Where the cluster's profile folder (its connection files) goes: the temp folder on one
    host; across hosts, ``~/.ipydist`` (or ``$IPYDIST_PROFILE_PARENT``), since the ranks on
    other hosts read the files there and a home folder is what a cluster's hosts share, where
    /tmp is each host's own. The folder is 0700 and removed when the cluster stops."""
    if not plan.multi_host:
        return None
    parent = os.environ.get("IPYDIST_PROFILE_PARENT") or os.path.expanduser("~/.ipydist")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    return parent


class Cluster:
    """The controller, mpiexec and its ranks, the client, and the watchdog of one cluster."""

    def __init__(self, plan: Plan, timeout: float):
        self.plan = plan
        self.np = plan.np
        self.timeout = timeout
        #: Ranks released by a cell that ended before every rank stopped: the ranks recover
        #: (``recovery.recover``) before the next cell, once all are idle.
        self.recovery_owed: list[int] | None = None
        #: One dict per rank, in rank order (see ``ipydist.rank.calls.info``).
        self.ranks: list[protocol.RankInfo] = []
        #: Each rank's ipyparallel engine id, in rank order: the rank's own number at start; a
        #: replacement for a rank that died (``--elastic``) registers under a new one.
        self.engine_ids: list[int] = []
        self.profile_dir: str | None = None
        #: ipyparallel's Client (untyped: Any to mypy), from when the ranks' controller is up
        #: until the stop (None before and after).
        self.client: Any = None
        #: ipyparallel.Cluster: controller and mpiexec launchers (from ``_launch`` on)
        self._ipp: Any | None = None
        #: (process, pipe write end): see ipydist.notebook.failures.watchdog
        self._watchdog: tuple[subprocess.Popen, int] | None = None
        self._views: dict[tuple[int, ...], object] = {}
        self._rank_procs: list = []  # psutil processes of the ranks on this host
        self._controller_proc: Any | None = None  # psutil's Process
        #: The ranks found dead when ipydist ended the job after a death
        #: (:meth:`end_job_after_a_death`): the first death is among them, not among the
        #: ranks it ended.
        self.first_dead: list[protocol.RankInfo] | None = None
        #: A rank was replaced, dropped or added since the start: MPI's world then holds a dead
        #: process or a spawned one, and its finalize may never end (a stop ends such a job
        #: at once, :meth:`_let_ranks_end`)
        self.world_changed = False
        #: The controller ended during the start (see :data:`CONTROLLER_LOST_NOTE`).
        self.controller_lost = False
        #: Why the cluster refuses cells (a heal that failed left no state it could go on
        #: in), None while it takes them.
        self.unusable: str | None = None
        #: The ranks' MPI shared-memory segments, looked up once they started: a rank killed
        #: leaves them, and the stop removes them.
        self._shared_memory: set[str] = set()
        #: How far the start got, and when (kept for the line under the start table).
        self.startup: startup.StartWatch | None = None
        #: The pids of the hot spares waiting (``--spares``), as rank 0 last said them.
        self.spare_pids: tuple[int, ...] = ()

    # --- starting ----------------------------------------------------------------------------

    def start(self, progress, started: float) -> None:
        """Start the controller and mpiexec at once, the watchdog, and wait for every rank,
        showing the steps on ``progress`` (a ``display.Progress``) with the seconds since
        ``started`` (a ``time.perf_counter()``), from which ``--timeout`` counts too.

        On failure the caller must still :meth:`stop`, which ends whatever did start.
        """
        self.startup = startup.StartWatch(
            self.np, f"Starting {self.np} ranks with {self.plan.title}",
            init=protocol.RankConfig.from_env(self.plan.env).init, started=started,
            live=progress.in_place, launcher=self.plan.command_name)
        self.startup.show(progress, None, [], force=True)
        self._launch()
        self.startup.launched()
        self._watchdog = watchdog.start(self.pids(), processes.heal_folders(self.plan.env))
        self._wait_for_ranks(progress, started + self.timeout)

    def _launch(self) -> None:
        import ipyparallel

        ip, location = mpiexec.controller_address(self.plan.multi_host, self.plan.route)
        self.profile_dir = tempfile.mkdtemp(prefix="ipydist-", dir=profile_parent(self.plan))
        cluster = self._ipp = ipyparallel.Cluster(
            profile_dir=self.profile_dir,
            n=self.np + self.plan.spares,  # the spares register only once they are ranks
            engines="mpi",
            controller_ip=ip,
            controller_location=location or "",
            delay=0,
            send_engines_connection_env=False,
            log_level=logging.ERROR,  # failures are reported by us, with MPI's output
            engine_timeout=int(self.timeout),
            controller_args=[
                # Registration completes on the first heartbeat after an engine connects;
                # ipyparallel's 3 s period would add up to 6 s to every start.
                f"--HeartMonitor.period={HEARTBEAT_MS}",
                "--HeartMonitor.max_heartmonitor_misses="
                f"{HEARTBEAT_MISSES_ACROSS_HOSTS if self.plan.multi_host else HEARTBEAT_MISSES}",
                *self._encryption_args(),
            ],
        )
        log_level = os.environ.get(protocol.ENGINE_LOG_LEVEL_ENV,
                                   protocol.DEFAULT_ENGINE_LOG_LEVEL)
        cfg = cluster.config.MPIEngineSetLauncher
        cfg.mpi_cmd = self.plan.command
        cfg.mpi_args = self.plan.args
        cfg.engine_cmd = [sys.executable, "-m", protocol.RANK_MODULE]
        cfg.engine_args = [
            f"--IPEngine.wait_for_url_file={self.timeout}",
            f"--log-level={log_level}",
            # ipyparallel's nanny (one more Python process per rank) exists to signal engines
            # on other hosts; on one host we signal the rank's pid ourselves.
            f"--IPEngine.enable_nanny={self.plan.multi_host}",
        ]
        cfg.environment = dict(self.plan.env)
        if not self.plan.multi_host:
            cfg.environment[protocol.RENDEZVOUS_PARENT_ENV] = self.profile_dir
        cfg.environment.update(self.plan.launcher.session_folder_env(self.plan, self.profile_dir))
        # A fork server per host, unless turned off (--env, the kernel's own environment, or
        # the plan: see launch/slurm.py): with Open MPI on this host the one this process
        # keeps between its clusters, elsewhere one of this cluster's own (a new name each
        # start; MPICH's too: one of its starts from a kept server once segfaulted in MPI's
        # init, in a full run, and it was not seen again, so it keeps what was proven).
        if os.environ.get(protocol.FORKSERVER_ENV) == "0":
            cfg.environment.setdefault(protocol.FORKSERVER_ENV, "0")
        elif protocol.FORKSERVER_ENV not in cfg.environment:
            keep = self.plan.launcher.keeps_forkserver(self.plan)
            cfg.environment[protocol.FORKSERVER_ENV] = (
                kept_forkserver.key_for(cfg.environment) if keep else secrets.token_hex(8))
        cluster.start_controller_sync()
        cluster.start_engines_sync()

    def _encryption_args(self) -> list[str]:
        """Across hosts (or with ipyparallel's own ``IPP_ENABLE_CURVE=1``), every socket of the
        controller is CurveZMQ: encrypted, and only a peer with the server key from this
        cluster's connection files (mode 0600, new keys per cluster) can connect. ipyparallel
        would then drop its HMAC signing as redundant; ipydist keeps it, with a key of its own,
        so a message must both come through the encrypted channel and carry the signature."""
        if not (self.plan.multi_host or os.environ.get("IPP_ENABLE_CURVE") == "1"):
            return []
        return ["--IPController.enable_curve=True", f"--Session.key={secrets.token_hex(32)}"]

    def _wait_for_ranks(self, progress, deadline: float) -> None:
        """Wait for registration, watching mpiexec so that a failed launch ends the wait."""
        launcher = self._launcher()
        watch = self.startup
        assert watch is not None  # start made it
        assert self._ipp is not None and self.profile_dir is not None  # so did _launch
        client_file = os.path.join(
            self.profile_dir, "security", f"ipcontroller-{self._ipp.cluster_id}-client.json")
        while True:
            if self.client is None and os.path.exists(client_file):
                try:
                    self.client = self._ipp.connect_client_sync()
                except TimeoutError as e:  # its hub did not answer (ipyparallel waits 10 s)
                    self.controller_lost = True
                    state = "still runs" if self.controller_alive() else "has ended"
                    raise ClusterError(
                        f"the ipyparallel controller (pid {self.controller_pid}) did not answer "
                        f"the notebook's connection within 10 s, and {state}"
                        f"{self._controller_said()}.") from e
            registered: list[int] = list(self.client.ids) if self.client is not None else []
            if len(registered) >= self.np:
                break
            if not self.controller_alive():  # the ranks would wait for its heartbeats for ever
                self.controller_lost = True
                raise ClusterError(f"the ipyparallel controller (pid {self.controller_pid}) "
                                   f"ended before the {self.np} ranks registered"
                                   f"{self._controller_said()}.")
            if not processes.alive(launcher.process):
                raise ClusterError(self._launch_failure(
                    f"{self.plan.command_name} exited before the {self.np} ranks started"))
            if watch.rank_ended:  # under --elastic mpiexec outlives it: a start never ends
                raise ClusterError(self._launch_failure(
                    f"a rank ended before the {self.np} ranks started"))
            if time.perf_counter() > deadline:
                watch.look(launcher.output_file, registered)
                raise ClusterError(self._launch_failure(
                    f"only {len(registered)} of {self.np} ranks started within --timeout "
                    f"{self.timeout:g} s; by then: {watch.so_far()}{self._queue_note()}"))
            watch.show(progress, launcher.output_file, registered)
            time.sleep(0.02)
        watch.show(progress, launcher.output_file, registered, force=True)
        infos = self.client[:].apply_sync(protocol.on_rank, protocol.ATTACH)
        self.ranks = sorted(infos, key=lambda i: i.rank)
        self.engine_ids = [info.rank for info in self.ranks]
        mismatched = [i.rank for i, eid in zip(infos, self.client.ids) if i.rank != eid]
        if mismatched:
            raise ClusterError(
                f"engine ids do not match MPI ranks for {describe_ranks(mismatched)}")
        if self.plan.spares:
            self.spare_pids = tuple(self.client[0].apply_sync(protocol.on_rank, protocol.SPARES))
        watch.ready()
        self._shared_memory = processes.shared_memory(
            [info.pid for info in self.ranks if processes.is_here(info)])

    def _queue_note(self) -> str:
        """For a Slurm job still waiting in the queue: why, as squeue says."""
        watch = self.startup
        assert watch is not None  # asked while the start waits
        if not self.plan.allocates or watch.job is None or watch.granted:
            return ""
        reason = slurm.pending_reason(watch.job)
        said = f" (squeue's reason: {reason})" if reason else ""
        return (f". Slurm job {watch.job} still waits for nodes{said}; it is cancelled. Ask "
                "for fewer ranks or another --partition, or give --timeout more seconds")

    def _controller_said(self) -> str:
        """The controller's last lines, as a clause ("" where it printed nothing)."""
        try:
            output = self._ipp.controller.get_output() if self._ipp is not None else ""
        except Exception:
            return ""
        lines = [line for line in (output or "").splitlines() if line.strip()][-3:]
        return f"; it said: {' / '.join(lines)}" if lines else ""

    def _launch_failure(self, what: str) -> str:
        """The message for a launch that failed, from what mpiexec and the ranks printed."""
        code = processes.exit_code(self._launcher().process)
        return mpiexec.describe_failure(what, self.launcher_output(), code, self.plan.mpiexec,
                                        self.plan.hint)

    # --- while it runs -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def slurm_job(self) -> str | None:
        """The Slurm job this cluster asked for with salloc (None: it made none)."""
        return self.startup.job if self.startup is not None and self.plan.allocates else None

    @property
    def controller_pid(self) -> int | None:
        return processes.started_pid(self._ipp.controller) if self._ipp else None

    @property
    def launcher_pid(self) -> int | None:
        return processes.started_pid(self._launcher())

    def view(self, targets: list[int]):
        """One DirectView per set of targets, reused: making one costs more than a small cell."""
        key = tuple(targets)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.client[self.engines(targets)]
        return view

    def engines(self, ranks) -> list[int]:
        """The engine ids of ``ranks``."""
        return [self.engine_ids[r] for r in ranks]

    def abort(self, msg_ids: list[str], ranks: list[int]) -> None:
        """Ask ``ranks`` to skip these requests if they have not begun them."""
        ipp.abort(self.client, msg_ids, self.engines(ranks))

    def replace_rank(self, rank: int, engine_id: int, info: protocol.RankInfo) -> None:
        """A replacement (engine ``engine_id``) now holds ``rank``; a rank one past the last
        joins the cluster (``Session.scale``)."""
        if rank == len(self.ranks):
            self.ranks.append(info)
            self.engine_ids.append(engine_id)
        else:
            self.ranks[rank] = info
            self.engine_ids[rank] = engine_id
        self._views = {}
        self._rank_procs = []
        self.world_changed = True

    def keep_ranks(self, ranks: list[int]) -> None:
        """Only ``ranks`` are left, renumbered from 0 in their order (the world went on
        without the others)."""
        self.ranks = [replace(self.ranks[old], rank=new) for new, old in enumerate(ranks)]
        self.engine_ids = [self.engine_ids[old] for old in ranks]
        self._views = {}
        self._rank_procs = []
        self.world_changed = True

    def drop_ranks(self, size: int) -> None:
        """The ranks from ``size`` up have left the cluster (``Session.scale``)."""
        del self.ranks[size:], self.engine_ids[size:]
        self._views = {}
        self._rank_procs = []
        self.world_changed = True

    def call(self, call: protocol.RankCall[R], *args, timeout: float,
             ranks: list[int] | None = None, ending: Collection[int] = ()) -> list[R]:
        """A rank call (``ipydist.rank.calls.<call.name>(*args)``, declared in
        :mod:`ipydist.protocol`'s table) on every rank (or on ``ranks``); the replies in rank
        order.

        Raises :class:`~ipydist.errors.RankTimeout` naming the ranks that did not answer
        within ``timeout``; their request is cancelled where it has not begun, so nothing
        queues behind it. ``ending``: ranks whose process ends once they answered (those that
        leave a shrinking world): where ipyparallel saw the process end before its answer
        came, the reply is None, not an error.
        """
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        ar = self.view(ranks).apply_async(protocol.on_rank, call, *args)
        if not ipp.wait(ar, timeout):
            late = ipp.still_running(ar, ranks)
            self.abort([ipp.msg_id(ar, ranks, r) for r in late], late)
            raise RankTimeout(f"{describe_ranks(late)} did not answer within {timeout:g} s")
        return ipp.results(ar, ranks, ending)

    def busy_ranks(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` still running (or queueing) a request of ours."""
        return [r for r in ranks if ipp.has_pending_requests(self.client, self.engine_ids[r])]

    def pids(self) -> list[int]:
        """Every process of the cluster on this host that we know of: ranks, nannies,
        controller, mpiexec. A rank on another host is left out: its pid means nothing here
        (here it may be another process, which must not be signalled); mpiexec's or Slurm's
        teardown ends it."""
        pids = [p for info in self.ranks if processes.is_here(info)
                for p in (info.pid, info.launched_pid, info.nanny_pid) if p]
        if not self.plan.multi_host:
            pids += self.spare_pids
        if self._ipp is not None:
            pids += [pid for launcher in [self._ipp.controller, *self._ipp.engines.values()]
                     if (pid := processes.started_pid(launcher))]
        return pids

    def watchdog_pid(self) -> int | None:
        return self._watchdog[0].pid if self._watchdog else None

    def dead_ranks(self) -> list[protocol.RankInfo]:
        """The ranks that are gone (see :meth:`_gone`), in one look."""
        if len(self._rank_procs) != len(self.ranks):  # looked up once per cluster
            self._rank_procs = [processes.local_process(info) for info in self.ranks]
        remote = [proc is None for proc in self._rank_procs]
        registered: set[int] = (set(self.client.ids) if any(remote) and self.client is not None
                                else set())
        return [info for info, proc in zip(self.ranks, self._rank_procs)
                if self._gone(info, proc, registered)]

    def _gone(self, info: protocol.RankInfo, proc, registered: set[int]) -> bool:
        """The one answer to "is this rank dead", for the cell's watch, the heal and
        ``%dist_status`` alike: on this host, by its process (``proc``), the authority here;
        on another host (``proc`` None), by the controller's heartbeat (an engine it stopped
        hearing from is no longer among the ``registered``). A rank here whose process runs
        but whose engine left (stopped, say) is not dead: its process may still go on."""
        if proc is not None:
            return not processes.alive(proc)
        return self.engine_ids[info.rank] not in registered

    def refusal(self, restart: str) -> str:
        """What a cell of a cluster that refuses cells is told ("" while it takes them);
        ``restart``: how the user starts a fresh one."""
        return f"{self.unusable}: run {restart} to start a fresh cluster." if self.unusable else ""

    def controller_alive(self) -> bool:
        """Whether the controller, through which every message to the ranks goes, still runs."""
        if self._controller_proc is None and self.controller_pid:
            self._controller_proc = processes.process(self.controller_pid)
        return self._controller_proc is None or processes.alive(self._controller_proc)

    def rank_state(self, rank: int) -> tuple[str, object]:
        """(``"idle"``, ``"busy"`` or ``"dead"``, the rank's psutil process or None); dead as
        :meth:`dead_ranks` has it (:meth:`_gone`)."""
        info = self.ranks[rank]
        proc = processes.local_process(info)
        if self._gone(info, proc, set(self.client.ids)):
            return "dead", None
        busy = ipp.has_pending_requests(self.client, self.engine_ids[rank])
        return ("busy" if busy else "idle"), proc

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        """Send ``sig`` to ranks: directly to local pids, through ipyparallel's nanny otherwise."""
        remote = []
        for r in parse_ranks(ranks, self.size):
            proc = processes.local_process(self.ranks[r])
            if proc is None:
                remote.append(r)
            elif processes.alive(proc):
                proc.send_signal(sig)
        if remote:
            self.client.send_signal(sig, targets=self.engines(remote), block=False)

    def launcher_output(self, wait_for_exit: float = 0.0) -> str:
        """What the launcher (mpiexec, srun) and the ranks printed (after waiting up to
        ``wait_for_exit`` seconds for a launcher that is ending the job, which prints its
        report as it goes), without the ranks' start markers: the output messages show."""
        launcher = self._launcher()
        deadline = time.monotonic() + wait_for_exit
        while processes.alive(launcher.process) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not processes.alive(launcher.process):
            # ipyparallel reads (and deletes) the output file when its loop hears of the exit,
            # which may wait for this very cell to end: read it first where it is still there
            if not launcher.stop_data and (text := processes.read_text(launcher.output_file)):
                return startup.as_shown(text)
            deadline = time.monotonic() + 2
            while not launcher.stop_data and time.monotonic() < deadline:
                time.sleep(0.02)
        if launcher.stop_data:
            return startup.as_shown(launcher.get_output(remove=False))
        return startup.as_shown(processes.read_text(launcher.output_file))

    def end_job_after_a_death(self, dead: list[protocol.RankInfo]) -> None:
        """End the job where the launcher leaves it running after a rank died: MPICH's
        ``mpiexec.gforker`` interrupts the other ranks, which ipyparallel's engines ignore,
        and a SIGTERM ends them only seconds later (their exit waits in MPI's finalize for
        the dead rank, until gforker's SIGQUIT). The others are killed, as mpiexec ends them;
        gforker then reports how each rank ended (``-exitinfo``) and exits. ``dead``: the
        ranks found dead (:meth:`dead_ranks`), remembered as :attr:`first_dead`."""
        if self.plan.launcher.ends_job_after_a_death:
            return
        if self.first_dead is None:
            self.first_dead = dead
        for info in self.ranks:
            processes.send(processes.local_process(info), signal.SIGKILL)
        # it takes in one child's end a second, unless a signal wakes it: 4 ranks took 3-4 s
        # to report, where a SIGTERM every 50 ms gets the report in 0.2 s
        launcher, deadline = self.launcher_process(), time.monotonic() + 2.0
        while processes.alive(launcher) and time.monotonic() < deadline:
            processes.send(launcher, signal.SIGTERM)
            time.sleep(0.05)

    def launcher_process(self):
        """mpiexec's (or srun's) process handle."""
        return self._launcher().process

    def _launcher(self):
        """ipyparallel's launcher of mpiexec or srun (it holds that process and its output)."""
        return next(iter(self._ipp.engines.values()), None) if self._ipp else None

    # --- stopping ----------------------------------------------------------------------------

    def stop(self, quiet: bool = False) -> None:
        """Stop engines, mpiexec and the controller, and make sure none of them is left, nor
        their shared memory (MPI's, and a heal's copy's)."""
        pids = processes.with_descendants(self.pids())
        segments = self._shared_memory | processes.shared_memory(pids)
        self._let_ranks_end()
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as e:  # carry on: the pid sweep below still ends the processes
                if not quiet:
                    print(f"ipydist: stopping the cluster: {e}", file=sys.stderr)
        processes.reap(pids)
        processes.remove_shared_memory(segments, pids)
        # and a heal's file, which a rank killed in the middle of the copy left
        processes.remove_heal_files(processes.heal_folders(self.plan.env), pids)
        self.plan.launcher.give_back(self.slurm_job)
        if self._watchdog is not None:
            proc, pipe = self._watchdog
            os.close(pipe)  # the watchdog finds nothing left to end, and exits
            try:
                proc.wait(timeout=5)
            except Exception:
                proc.kill()
            self._watchdog = None
        if self.profile_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        self._ipp = self.client = self.profile_dir = None
        self._views = {}
        self._rank_procs = []
        self.engine_ids = []
        self._controller_proc = None

    def _let_ranks_end(self) -> None:
        """Ask the ranks to end (SIGTERM: ipyparallel's engine stops its loop, and the rank
        ends as Python's exit would be seen), and wait up to :data:`RANKS_END_SECONDS` for
        mpiexec to see its job over. Only when every rank is alive and idle: a busy rank goes
        on with its request, and a dead one would keep its peers in MPI's finalize; such a
        job is ended by mpiexec at once, as before, and so is one whose world changed (after
        a heal, Open MPI's finalize deadlocked holding the GIL on the ranks of another
        host)."""
        launcher = self._launcher()
        proc = getattr(launcher, "process", None)
        if (proc is None or self.client is None or not self.ranks or self.world_changed
                or not processes.alive(proc)):
            return
        try:
            if self.dead_ranks() or self.busy_ranks(list(range(self.size))):
                return
            self.signal(signal.SIGTERM)
        except Exception:  # a controller gone: mpiexec ends the job
            return
        # ranks on this host are watched by their processes (mpiexec takes 0.3 s more to
        # exit, and is ended at once by the stop); others by mpiexec's end of the job
        watched = [proc] if None in self._rank_procs else self._rank_procs
        deadline = time.monotonic() + RANKS_END_SECONDS
        while any(processes.alive(p) for p in watched) and time.monotonic() < deadline:
            time.sleep(0.02)
