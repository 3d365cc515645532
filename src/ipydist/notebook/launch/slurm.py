"""Starting the ranks with Slurm (``--launcher slurm``): its own commands, not a launcher of ours.

Inside an allocation (``SLURM_JOB_ID`` set: a batch job, ``salloc``, a notebook server that a
JupyterHub spawner started in a job), the ranks are one ``srun`` job step in it. Outside one (a
login node), ``salloc`` asks for a new allocation, with ``--partition``, ``--time`` and
``--account`` passed through, and runs that ``srun`` in it; the job lives as long as the cluster
(``salloc`` gives it back when ``srun`` ends, and the ``Slurm`` launcher makes sure).
``salloc`` rather than ``sbatch``: the job is tied to the notebook, its output (MPI's and the
ranks' start lines) streams back as mpiexec's does, and a kernel that dies takes it down, where
a batch job would run on by itself and write to a file.

ipyparallel's MPI launcher runs either command as it runs mpiexec (``COMMAND -n N ARGS
program``), so start, output, exit and stop work the same. Everything here but
:func:`partition_nodes` and :func:`pending_reason` is a pure rule.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from ipydist import protocol
from ipydist.errors import LaunchError
from ipydist.notebook.launch import launchers
from ipydist.notebook.launch.hosts import Hosts, in_step, with_route
from ipydist.notebook.launch.hosts import choose as choose_hosts
from ipydist.notebook.launch.launchers import openmpi_tuning
from ipydist.notebook.launch.mpiexec import find_mpiexec, mpi_flavor
from ipydist.notebook.launch.plan import Plan, program_of
from ipydist.specs import SpecError

#: srun's ``--mpi`` plugin for each MPI (the wheels': Open MPI's PMIx, MPICH's PMI-2). Without
#: one, srun starts N separate MPI worlds of one rank each.
MPI_PLUGINS = {"openmpi": "pmix", "mpich": "pmi2"}
#: How many of a partition's nodes are looked at to find the interface that reaches them.
ROUTE_SAMPLE = 8


@dataclass
class Request:
    """What the user asked Slurm for: allocation options (outside an allocation) and extra
    arguments (to ``salloc`` outside an allocation, to ``srun`` inside one)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    args: list[str] = field(default_factory=list)

    def allocation_options(self) -> list[str]:
        named = [("--partition", self.partition), ("--time", self.time),
                 ("--account", self.account)]
        return [f"{option}={value}" for option, value in named if value]


def current_job(env=None) -> str | None:
    """The allocation this process runs in, if any."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


def check_request(request: Request, launcher: str, mpiexec_options: list[str],
                  env=None) -> None:
    """Refuse, with what to do instead: Slurm options without ``--launcher slurm``; mpiexec's
    host options with it; allocation options inside an allocation."""
    allocation = [o.split("=")[0] for o in request.allocation_options()]
    given = allocation + (["--slurm-args"] if request.args else [])
    if launcher != "slurm":
        if given:
            raise SpecError(f"{' and '.join(given)}: these ask Slurm for the ranks; add "
                            "--launcher slurm.")
        return
    if mpiexec_options:
        raise SpecError(
            f"{' and '.join(mpiexec_options)}: with --launcher slurm, Slurm places the ranks "
            "and mpiexec is not used. Ask Slurm for nodes with --slurm-args, e.g. "
            '--slurm-args="--nodes=2 --nodelist=nodeA,nodeB".')
    job = current_job(env)
    if job and allocation:
        raise SpecError(
            f"{' and '.join(allocation)}: this notebook runs inside Slurm job {job}, and "
            "--launcher slurm starts the ranks in it (srun). Leave them out, or run the "
            "notebook outside the job to ask for a new allocation.")


def mpi_flavor_of(mpi: str | None) -> str:
    """The MPI the ranks' mpi4py uses, told by the mpiexec next to it (``--mpi``, or the
    default search): it decides srun's ``--mpi`` plugin."""
    try:
        return mpi_flavor(find_mpiexec(mpi))
    except LaunchError:
        return "unknown"


def ranks_and_hosts(np_given: int | None, request: Request, env=None,
                    ) -> tuple[int, Hosts | None]:
    """(how many ranks, on which hosts): inside an allocation, its tasks (by default) on its
    nodes; outside one, ``--np`` (required: it is what salloc asks for) on nodes of the
    partition, which only serve to find the way to them (None: they are all this host)."""
    env = os.environ if env is None else env
    job = current_job(env)
    if job:
        named = choose_hosts(env=env)
        if named is None:
            return np_given or 1, None
        np = np_given or named.slots
        if np > named.slots:
            raise SpecError(
                f"--np {np}: Slurm job {job} has {named.slots} tasks ({named.source}). Ask for "
                "fewer ranks, or run the notebook in a larger allocation.")
        return np, named
    if np_given is None:
        raise SpecError(
            "--launcher slurm outside a Slurm allocation: give --np, the number of ranks "
            "(tasks) to ask Slurm for, e.g. --np 8 --partition gpu --time 1:00:00.")
    nodes = partition_nodes(request.partition, env)
    source = f"Slurm partition {request.partition}" if request.partition else "Slurm's nodes"
    named = with_route(Hosts([(node, 1) for node in nodes], source))
    return np_given, named if named.multi_host else None


def find(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise LaunchError(
            f"--launcher slurm: {name} is not on PATH. Run the notebook where Slurm's client "
            "commands are installed (a login node of the cluster), or leave --launcher out to "
            "start the ranks with mpiexec.")
    return path


def plan(np: int, flavor: str, request: Request, rank_env: dict[str, str],
         hosts: Hosts | None, env=None) -> Plan:
    """The launch by Slurm: the command, and the ranks' environment (srun hands the notebook's
    whole environment to the tasks, ``--export=ALL``). ``hosts``: the allocation's nodes, or
    some of the partition's, for the way to them (None: this host)."""
    env = os.environ if env is None else env
    command, args = commands(np, flavor, request, env)
    route = hosts.route if hosts is not None else None
    rank_env = dict(rank_env)
    if route is None and "GLOO_SOCKET_IFNAME" not in env:
        rank_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if flavor == "openmpi":
        rank_env = {**openmpi_tuning(env), **rank_env}
    # Each rank imports torch itself: Slurm accounts for, binds and confines each task as the
    # process srun started, where a forked rank would be counted and confined as the fork
    # server (ipydist.rank.start.forkserver).
    rank_env.setdefault(protocol.FORKSERVER_ENV, "0")
    if flavor == "openmpi" and not any(k.startswith("OMPI_MCA_btl") for k in env):
        # as with mpiexec: across hosts MPI's TCP on the hosts' network, on one host shared
        # memory only (srun has no --mca: Open MPI reads these from the environment)
        if route is not None:
            rank_env["OMPI_MCA_btl_tcp_if_include"] = route.network
        else:
            rank_env["OMPI_MCA_btl"] = "self,sm"
    job = current_job(env)
    hint = ("Check --partition, --time, --account and --slurm-args against what Slurm says "
            "above (sinfo lists the partitions and their limits).")
    return Plan(program_of(command), flavor, args, rank_env, route is not None, [], route,
                hosts, command=command, launcher=launchers.Slurm(job), hint=hint,
                allocates=not job, np=np)


def commands(np: int, flavor: str, request: Request, env=None) -> tuple[list[str], list[str]]:
    """(the command ipyparallel runs before ``-n N``, the arguments after it): ``srun`` in the
    current allocation, or ``salloc ... srun`` for a new one."""
    env = os.environ if env is None else env
    step = []
    user = list(request.args)
    if not env.get("SLURM_MPI_TYPE") and not any(a.startswith("--mpi") for a in user):
        step.append(f"--mpi={MPI_PLUGINS.get(flavor, 'pmix')}")
    # a rank that dies takes the step down, as mpiexec ends the job
    step += ["--kill-on-bad-exit=1", "--export=ALL"]
    srun = find("srun")
    if current_job(env):
        if in_step(env) and not any(a in STEP_SHARING for a in user):
            # the notebook's step (JupyterLab's) holds some of the allocation's CPUs until it
            # ends: without --overlap the ranks' step would wait for them for ever
            step.append("--overlap")
        return [*without_step_layout(env), srun], step + user
    allocate = [find("salloc"), f"--ntasks={np}", *request.allocation_options()]
    if not any(a in ("-J", "--job-name") or a.startswith("--job-name=") for a in user):
        allocate.append("--job-name=ipydist")
    return [*allocate, *user, srun], step


#: What srun says of the step it started, in its tasks' environment, and reads back as its own
#: options when one of those tasks runs srun again: a notebook in a step of its allocation
#: (JupyterLab started by ``srun -N1 -n1``) would give the ranks that one task's layout
#: (``cyclic``: srun's choice for as few tasks as nodes).
STEP_LAYOUT = ("SLURM_DISTRIBUTION", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES",
               "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_CPU_BIND")


#: srun's options that say whether a step shares the allocation's CPUs with other steps.
STEP_SHARING = ("--overlap", "--exclusive")


def without_step_layout(env) -> list[str]:
    """``env -u ...`` for the step layout variables set, inside a job step; nothing elsewhere
    (a batch script's or salloc's shell: those are the allocation's, or the user's)."""
    if not in_step(env):
        return []
    unset = [a for name in STEP_LAYOUT if name in env for a in ("-u", name)]
    return [shutil.which("env") or "/usr/bin/env", *unset] if unset else []


_JOB_LINE = re.compile(r"(?:Pending|Granted) job allocation (\d+)")
_GRANTED = re.compile(r"Granted job allocation (\d+)")


def allocation_in(output: str) -> tuple[str | None, bool]:
    """(the job id salloc named in its output, whether it was granted yet)."""
    job = None
    for m in _JOB_LINE.finditer(output):
        job = m.group(1)
    return job, bool(job and _GRANTED.search(output))


def partition_nodes(partition: str | None, env=None) -> list[str]:
    """Names of (up to ROUTE_SAMPLE of) the nodes the allocation may get: ``sinfo``'s view of
    the partition (or of every partition). Used only to find the way to them."""
    argv = [find("sinfo"), "-h", "-N", "-o", "%N"]
    if partition:
        argv += ["-p", partition]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"--launcher slurm: sinfo did not answer ({e}).") from None
    nodes = list(dict.fromkeys(done.stdout.split()))
    if done.returncode != 0 or not nodes:
        where = f"partition {partition}" if partition else "any partition"
        said = (done.stderr or done.stdout).strip()
        raise LaunchError(
            f"--launcher slurm: sinfo lists no node in {where}" + (f" ({said})" if said else "")
            + ". Check --partition (sinfo lists them) and SLURM_CONF.")
    return nodes[:ROUTE_SAMPLE]


def pending_reason(job: str) -> str | None:
    """Why Slurm has not started ``job`` yet, in squeue's words (``Resources``, ``Priority``,
    ``PartitionNodeLimit``...); None if squeue does not say."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return None
    try:
        done = subprocess.run([squeue, "-h", "-j", job, "-o", "%r"], capture_output=True,
                              text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    reason = done.stdout.strip()
    return reason if done.returncode == 0 and reason and reason != "None" else None
