"""What ``Session.start`` launches: the hosts, the ranks' configuration and mpiexec's (or
Slurm's) plan, each option checked against the others before anything starts."""

from __future__ import annotations

import os
import shlex

from ipydist import protocol
from ipydist.notebook.launch import local_gpus, mpiexec, slurm
from ipydist.notebook.launch.hosts import choose as choose_hosts
from ipydist.notebook.launch.plan import Plan
from ipydist.specs import SpecError, StartOptions, format_gpus


def plan_launch(options: StartOptions) -> Plan:
    """The launch of ``options``: its ``np`` (as given, else from the hosts, the allocation,
    the GPUs or the cores) and whether it is ``elastic`` (what the launcher can do) decided
    here, nothing else changed. Raises SpecError for options that do not go together."""
    if options.spares and options.elastic is False:
        raise SpecError(f"--spares {options.spares} with --no-elastic: spares take the place of "
                        "a rank that dies, which only an elastic cluster outlives; leave one "
                        "of them out.")
    if options.launcher == "slurm" and (options.elastic or options.spares):
        raise SpecError(
            "--elastic (or --spares) with --launcher slurm: srun cannot replace a rank. "
            "Inside a Slurm allocation, --launcher mpiexec starts Open MPI's daemons through "
            "Slurm and heals; or leave --elastic out.")
    request = slurm.Request(options.partition, options.time_limit, options.account,
                            shlex.split(options.slurm_args))
    slurm.check_request(request, options.launcher, _host_options(options))
    if options.launcher == "slurm":
        np, named = slurm.ranks_and_hosts(options.np, request)
    else:
        named = choose_hosts(options.hosts, options.hostfile, shlex.split(options.mpi_args))
        np = options.np or (named.slots if named is not None else
                            local_gpus.default_np(options.gpus, options.gpus_per_rank,
                                                  os.environ.get("CUDA_VISIBLE_DEVICES")))
        if named is not None and np > named.slots and "--oversubscribe" not in options.mpi_args:
            raise SpecError(
                f"--np {np}: {named.source} gives {named.slots} slots. Name more "
                "slots (nodeA:4), or pass --mpi-args=--oversubscribe to share them.")
    route = named.route if named is not None else None
    config = protocol.RankConfig(
        gpus=format_gpus(options.gpus), gpus_per_rank=options.gpus_per_rank,
        backend=options.backend, transport=options.transport,
        init=options.init,
        notebook_addr=route.address if route else "")
    rank_env = {**config.to_env(), **options.env}
    if options.launcher == "slurm":
        plan = slurm.plan(np, slurm.mpi_flavor_of(options.mpi), request, rank_env, named)
    else:
        plan = mpiexec.plan(mpiexec.find_mpiexec(options.mpi), np, options.mpi_args,
                            rank_env, hosts=named, elastic=options.elastic,
                            spares=options.spares)
    if options.min_np is not None and options.min_np > np:
        raise SpecError(f"--min-np {options.min_np}: more than the {np} ranks to start; "
                        "give at most --np, or leave it out.")
    if options.min_np is not None and not plan.elastic:
        raise SpecError(f"--min-np {options.min_np}: the cluster cannot go on without a rank "
                        "unless it is elastic: leave --no-elastic out (or pass --elastic, "
                        "which needs Open MPI's fault tolerance), or leave --min-np out.")
    return plan


def _host_options(options: StartOptions) -> list[str]:
    """The mpiexec options given, which --launcher slurm has no use for."""
    given = [("--hosts", options.hosts), ("--hostfile", options.hostfile),
             ("--mpi-args", options.mpi_args)]
    return [option for option, value in given if value]
