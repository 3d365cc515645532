"""What ``Session.start`` launches: the hosts, the ranks' configuration and mpiexec's (or
Slurm's) plan, each option checked against the others before anything starts."""

from __future__ import annotations

import shlex

from ipydist import protocol
from ipydist.notebook.launch import mpiexec, slurm
from ipydist.notebook.launch.hosts import choose as choose_hosts
from ipydist.specs import SpecError, format_gpus


def plan_launch(session):
    """The launch plan of ``session`` (a :class:`~ipydist.session.Session`); sets its ``np``
    (from the hosts or the allocation, where not given) and ``elastic`` (what the plan can
    do). Raises SpecError for options that do not go together."""
    if session.launcher == "slurm" and session.elastic_asked:
        raise SpecError(
            "--elastic with --launcher slurm: srun cannot replace a rank. Inside a Slurm "
            "allocation, --launcher mpiexec starts Open MPI's daemons through Slurm and "
            "heals; or leave --elastic out.")
    slurm.check_request(session.slurm, session.launcher, _host_options(session))
    if session.launcher == "slurm":
        session.np, named = slurm.ranks_and_hosts(session.np_given, session.slurm)
    else:
        named = choose_hosts(session.hosts, session.hostfile, shlex.split(session.mpi_args))
        if named is not None:
            session.np = session.np_given or named.slots
            if session.np > named.slots and "--oversubscribe" not in session.mpi_args:
                raise SpecError(
                    f"--np {session.np}: {named.source} gives {named.slots} slots. Name more "
                    "slots (nodeA:4), or pass --mpi-args=--oversubscribe to share them.")
    route = named.route if named is not None else None
    config = protocol.RankConfig(
        gpus=format_gpus(session.gpus), gpus_per_rank=session.gpus_per_rank,
        backend=session.backend, transport=session.transport,
        init=session.init,
        notebook_addr=route.address if route else "")
    rank_env = {**config.to_env(), **session.env}
    if session.launcher == "slurm":
        plan = slurm.plan(session.np, slurm.mpi_flavor_of(session.mpi), session.slurm, rank_env,
                          named)
    else:
        plan = mpiexec.plan(mpiexec.find_mpiexec(session.mpi), session.np, session.mpi_args,
                            rank_env, hosts=named, elastic=session.elastic_asked)
    session.elastic = plan.elastic
    if session.min_np is not None and session.min_np > session.np:
        raise SpecError(f"--min-np {session.min_np}: more than the {session.np} ranks to start; "
                        "give at most --np, or leave it out.")
    if session.min_np is not None and not session.elastic:
        raise SpecError(f"--min-np {session.min_np}: the cluster cannot go on without a rank "
                        "unless it is elastic: add --elastic (Open MPI's fault tolerance), "
                        "or leave --min-np out.")
    return plan


def _host_options(session) -> list[str]:
    """The mpiexec options given, which --launcher slurm has no use for."""
    given = [("--hosts", session.hosts), ("--hostfile", session.hostfile),
             ("--mpi-args", session.mpi_args)]
    return [option for option, value in given if value]
