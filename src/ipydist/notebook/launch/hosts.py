"""Which hosts the ranks run on, named by the user or by Slurm, and how the notebook reaches
them: pure rules plus a look at the routing table (:mod:`ipydist.network`).

Where hosts come from, first match wins: ``--hosts nodeA:4,nodeB:4``; ``--hostfile FILE`` (Open
MPI's or MPICH's syntax); hosts named in ``--mpi-args`` (``--host``, ``--hostfile``); inside a
Slurm allocation (``SLURM_JOB_ID`` set), the allocation's nodes and tasks per node. Otherwise
this host alone, where nothing needs to listen beyond loopback.

A notebook can run inside one step of its allocation: JupyterLab started with ``srun`` on the
first node, or by a spawner's batch script. There Slurm describes the step, not the allocation,
in ``SLURM_TASKS_PER_NODE`` (``1``), so the allocation's tasks are asked of ``scontrol``
instead (see :func:`allocation_tasks`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from ipydist import network, protocol
from ipydist.errors import LaunchError
from ipydist.specs import SpecError, parse_hostfile, parse_hosts


@dataclass
class Hosts:
    """The hosts of one cluster: ``[(name, slots)]``, where that came from, and (across
    hosts) this host's :class:`~ipydist.network.Route` to them."""

    hosts: list[tuple[str, int]]
    source: str
    route: network.Route | None = None

    @property
    def slots(self) -> int:
        return sum(slots for _, slots in self.hosts)

    @property
    def multi_host(self) -> bool:
        return self.route is not None


def choose(hosts: str | None = None, hostfile: str | None = None,
           mpi_args: list[str] | None = None, env=None) -> Hosts | None:
    """The cluster's hosts (see the module's docstring), or None for this host alone."""
    env = os.environ if env is None else env
    if hosts and hostfile:
        raise SpecError("--hosts and --hostfile both name hosts: give one of them.")
    if hosts:
        return with_route(Hosts(parse_hosts(hosts), f"--hosts {hosts}"))
    if hostfile:
        return with_route(Hosts(_read_hostfile(hostfile, "--hostfile"), f"--hostfile {hostfile}"))
    if named := _hosts_in_mpi_args(mpi_args or []):
        return with_route(named)
    if env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST"):
        nodes = expand_nodelist(env["SLURM_JOB_NODELIST"])
        tasks = allocation_tasks(env, len(nodes))
        return with_route(Hosts(list(zip(nodes, tasks)),
                                 f"Slurm allocation {env['SLURM_JOB_ID']}"))
    return None


def with_route(hosts: Hosts) -> Hosts:
    """Find how this host reaches the others (none needed when every host is this one)."""
    remote = [name for name, _ in hosts.hosts if not network.is_local(name)]
    if not remote:
        return hosts
    routes = {}
    for name in remote:
        try:
            routes[name] = network.route_to(name)
        except OSError as e:
            raise LaunchError(
                f"{hosts.source}: cannot reach host {name} from here ({e}). Check the name "
                "(ping it), or run the notebook on a host that reaches every rank's host.") from e
    override = os.environ.get(protocol.NOTEBOOK_ADDR_ENV)
    if override:  # the user's choice where several interfaces lead to the hosts
        interface, net = network.interface_of(override)
        hosts.route = network.Route(override, interface, net)
        return hosts
    addresses = {r.address for r in routes.values()}
    if len(addresses) > 1:
        by = ", ".join(f"{name} via {r}" for name, r in routes.items())
        raise LaunchError(
            f"{hosts.source}: the hosts are reached through different interfaces ({by}); "
            f"ipydist listens on one. Name hosts on one network, or set "
            f"{protocol.NOTEBOOK_ADDR_ENV} to the address they all reach.")
    hosts.route = next(iter(routes.values()))
    return hosts


def _read_hostfile(path: str, option: str) -> list[tuple[str, int]]:
    try:
        with open(os.path.expanduser(path)) as f:
            text = f.read()
    except OSError as e:
        raise SpecError(f"{option} {path}: cannot read it ({e.strerror}).") from None
    return parse_hostfile(text, f"{option} {path}")


_HOST_VALUE_OPTIONS = {"--host", "-host", "-H", "--hosts", "-hosts"}
_HOSTFILE_OPTIONS = {"--hostfile", "-hostfile", "--machinefile", "-machinefile", "-f"}


def _hosts_in_mpi_args(args: list[str]) -> Hosts | None:
    """Hosts that the user's own mpiexec arguments name, so the wire is set up for them too."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if name in _HOST_VALUE_OPTIONS and value:
            return Hosts(parse_hosts(value), f"--mpi-args {name} {value}")
        if name in _HOSTFILE_OPTIONS and value:
            return Hosts(_read_hostfile(value, f"--mpi-args {name}"),
                         f"--mpi-args {name} {value}")
    return None


_BRACKETS = re.compile(r"^(?P<prefix>[^\[,]*)\[(?P<ranges>[^\]]+)\](?P<suffix>[^,]*)$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact node list (``node[01-03,07],gpu1``) as names, in order."""
    names: list[str] = []
    for part in _split_top(nodelist):
        m = _BRACKETS.match(part)
        if not m:
            names.append(part)
            continue
        for piece in m.group("ranges").split(","):
            lo, _, hi = piece.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                names.append(f"{m.group('prefix')}{n:0{len(lo)}d}{m.group('suffix')}")
    return names


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p for p in [*parts, current] if p]


def expand_tasks(tasks_per_node: str, nodes: int) -> list[int]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) as one count per node; one each when
    it is missing."""
    counts: list[int] = []
    for part in filter(None, tasks_per_node.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return [1] * nodes
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts if len(counts) == nodes else [1] * nodes



def in_step(env) -> bool:
    """Whether this process runs in a job step that srun started (``SLURM_STEP_ID``), not in a
    batch script or salloc's shell."""
    return bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))


def allocation_tasks(env, nodes: int) -> list[int]:
    """The allocation's tasks on each of its ``nodes``. Outside a job step (a batch script,
    ``salloc``'s shell), ``SLURM_TASKS_PER_NODE`` says it; inside one (``SLURM_STEP_ID`` set),
    that variable is the step's, and the allocation's come from ``scontrol show job``."""
    if not in_step(env):
        return expand_tasks(env.get("SLURM_TASKS_PER_NODE", ""), nodes)
    scontrol = shutil.which("scontrol")
    shown = ""
    if scontrol:
        try:
            shown = subprocess.run([scontrol, "show", "job", "--oneliner", env["SLURM_JOB_ID"]],
                                   capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            shown = ""
    return tasks_in_job(shown, env.get("SLURM_JOB_CPUS_PER_NODE", ""), nodes)


def tasks_in_job(scontrol_job: str, cpus_per_node: str, nodes: int) -> list[int]:
    """The tasks of a job on each node, from ``scontrol show job``'s ``NumTasks``,
    ``CPUs/Task`` and ``NtasksPerN`` and the job's ``SLURM_JOB_CPUS_PER_NODE`` (``2(x3),1``):
    its tasks per node where it asked for a number, else its tasks spread evenly over its nodes,
    at most what each node's CPUs hold. Without scontrol's answer, what the CPUs hold (one task
    a CPU)."""
    cpus = expand_tasks(cpus_per_node, nodes)
    field = {k: v for k, v in re.findall(r"([\w/:]+)=(\S+)", scontrol_job)}
    per_task = int(field["CPUs/Task"]) if field.get("CPUs/Task", "").isdigit() else 1
    fits = [max(1, c // max(1, per_task)) for c in cpus]
    per_node = field.get("NtasksPerN:B:S:C", "0").split(":")[0]
    if per_node.isdigit() and int(per_node) > 0:
        return [int(per_node)] * nodes
    if not field.get("NumTasks", "").isdigit():
        return fits
    left = int(field["NumTasks"])
    counts = [0] * nodes
    while left > 0 and any(c < f for c, f in zip(counts, fits)):
        for i in range(nodes):
            if left and counts[i] < fits[i]:
                counts[i] += 1
                left -= 1
    return [max(1, c) for c in counts]
