"""Starting a cluster: the controller and mpiexec's ranks at the same time, then waiting for
every rank to register while watching mpiexec, so that a launch that fails ends the wait at
once with MPI's own message instead of running into ``--timeout``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

from ipydist import launch, processes
from ipydist.errors import ClusterError
from ipydist.specs import describe_ranks

#: Controller heartbeat: a rank is declared gone after HEARTBEAT_MS * HEARTBEAT_MISSES ms.
HEARTBEAT_MS = 200
HEARTBEAT_MISSES = 50


def launch_cluster(session, plan: launch.MpiexecPlan) -> None:
    """Start the controller and mpiexec (the ranks) at once, and the cluster's watchdog."""
    import ipyparallel as ipp

    ip, location = launch.controller_address(plan.multi_host)
    session._profile_dir = tempfile.mkdtemp(prefix="ipydist-")
    cluster = ipp.Cluster(
        profile_dir=session._profile_dir,
        n=session.np,
        engines="mpi",
        controller_ip=ip,
        controller_location=location or "",
        delay=0,
        send_engines_connection_env=False,
        log_level=logging.ERROR,  # failures are reported by us, with MPI's output
        engine_timeout=int(session.timeout),
        controller_args=[
            # Registration completes on the first heartbeat after an engine connects;
            # ipyparallel's 3 s period would add up to 6 s to every start.
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
        ],
    )
    cfg = cluster.config.MPIEngineSetLauncher
    cfg.mpi_cmd = [plan.mpiexec]
    cfg.mpi_args = plan.args
    cfg.engine_cmd = [sys.executable, "-m", "ipydist.engine"]
    cfg.engine_args = [
        f"--IPEngine.wait_for_url_file={session.timeout}",
        f"--log-level={os.environ.get('IPYDIST_ENGINE_LOG_LEVEL', 'WARN')}",
        # ipyparallel's nanny (one more Python process per rank) exists to signal engines
        # on other hosts; on one host the session signals the rank's pid itself.
        f"--IPEngine.enable_nanny={plan.multi_host}",
    ]
    cfg.environment = plan.env
    session._cluster = cluster
    cluster.start_controller_sync()
    cluster.start_engines_sync()


def engine_set(session):
    """ipyparallel's launcher of mpiexec (it holds mpiexec's process and output)."""
    return next(iter(session._cluster.engines.values()), None) if session._cluster else None


def wait_for_ranks(session, plan, progress, deadline: float) -> None:
    """Wait for registration, watching mpiexec so that a failed launch ends the wait."""
    launcher = engine_set(session)
    client = None
    while True:
        if client is None and os.path.exists(_client_file(session)):
            client = session._client = session._cluster.connect_client_sync()
        registered = len(client.ids) if client is not None else 0
        if registered >= session.np:
            break
        if not processes.alive(launcher.process):
            raise ClusterError(_launch_failure(
                session, plan, f"mpiexec exited before the {session.np} ranks started"))
        if time.perf_counter() > deadline:
            raise ClusterError(_launch_failure(
                session, plan, f"only {registered} of {session.np} ranks started within "
                f"--timeout {session.timeout:g} s"))
        progress.update(
            f"Starting {session.np} ranks with {plan.flavor} mpiexec: "
            f"{registered}/{session.np} ready"
        )
        time.sleep(0.02)
    from ipydist.engine import rank_info

    infos = client[:].apply_sync(rank_info)
    session.ranks = sorted(infos, key=lambda i: i["rank"])
    mismatched = [i["rank"] for i, eid in zip(infos, client.ids) if i["rank"] != eid]
    if mismatched:
        raise ClusterError(
            f"engine ids do not match MPI ranks for {describe_ranks(mismatched)}"
        )


def _client_file(session) -> str:
    return os.path.join(
        session._profile_dir, "security", f"ipcontroller-{session._cluster.cluster_id}-client.json"
    )


def _launch_failure(session, plan, what: str) -> str:
    """The message for a launch that failed, from what mpiexec and the ranks printed."""
    launcher = engine_set(session)
    return launch.describe_failure(
        what, mpiexec_output(session), processes.exit_code(launcher.process), plan.mpiexec
    )


def mpiexec_output(session, wait_for_exit: float = 0.0) -> str:
    """What mpiexec and the ranks printed (after waiting up to ``wait_for_exit`` seconds for
    a mpiexec that is ending the job, which prints its report as it goes)."""
    launcher = engine_set(session)
    deadline = time.monotonic() + wait_for_exit
    while processes.alive(launcher.process) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not processes.alive(launcher.process):
        # ipyparallel reads (and deletes) the output file when it notices the exit.
        deadline = time.monotonic() + 2
        while not launcher.stop_data and time.monotonic() < deadline:
            time.sleep(0.02)
    if launcher.stop_data:
        return launcher.get_output(remove=False)
    return processes.read_text(launcher.output_file)

