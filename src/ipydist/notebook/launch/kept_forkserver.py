"""The fork server this process keeps for its clusters on its own host, between one cluster and
the next, so that a restart does not import torch again.

A fork server (``ipydist.rank.start.forkserver``) imports torch once and forks a host's ranks.
One a cluster's first stub starts ends with that cluster's last rank, and the next start
imports torch again: a 4-rank start took 2.4 s, 1.8 s of it importing, where it takes 1.4 s
from a server already running, and the import cost about 2 CPU-seconds each time (a notebook
that restarts its cluster after a change, and the test suite, do it all the time).

So on its own host the notebook starts the server itself, and keeps it. It ends with the
notebook's process, whatever ends that: the server holds the read end of a pipe whose write
end only this process holds (:data:`~ipydist.protocol.FORKSERVER_OWNER_ENV`); the kernel's
end, SIGKILL included, closes it. :func:`stop_all` ends the servers at once (at exit too).

What a server imports may depend on the environment it sees then (``OMP_NUM_THREADS`` is
read as OpenMP loads; ``LD_PRELOAD``, ``PYTHONPATH``), so a server is kept for the environment
its ranks get, less what no module it imports reads (:data:`NOT_READ_ON_IMPORT`: ipydist's
own variables and ipyparallel's, which the ranks read after the fork; MPI's launch
variables, read by MPI's init in the rank; pytest's bookkeeping): a start with another
``--env OMP_NUM_THREADS=2`` gets a server of its own, one with another ``--transport`` not.
At most :data:`KEPT_MAX` are kept, the one used longest ago ended first, unless a running
cluster still uses it. Only with Open MPI on this host: across hosts, under Slurm and with
MPICH each cluster's stubs start their own (see the server's module).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass

import psutil

from ipydist import protocol
from ipydist.notebook.launch import processes

#: How many servers (one per environment) are kept at once: each holds torch imported, about
#: 300 MB, and a notebook's clusters mostly share one environment. More run while clusters
#: use them.
KEPT_MAX = 2
#: Variables by the start of their names that no module a server imports reads as it is
#: imported: the ranks read them after the fork (ipydist's, ipyparallel's), MPI's init reads
#: them in the rank (Open MPI's, PRRTE's, PMIx's), or they change at every test (pytest's).
NOT_READ_ON_IMPORT = ("IPYDIST_", "IPP_", "OMPI_", "PRTE_", "PMIX_", "PYTEST_")


@dataclass
class Kept:
    key: str
    process: subprocess.Popen
    pipe: int  # the write end: closed, the server ends

    def alive(self) -> bool:
        return self.process.poll() is None

    def serving(self) -> bool:
        """Whether ranks it forked still run (its children): a cluster still uses it, and its
        ranks' stubs learn from it how their rank ended, for mpiexec's report of a death."""
        try:
            return bool(psutil.Process(self.process.pid).children())
        except psutil.Error:
            return False

    def end(self) -> None:
        """Close its pipe (which ends it), and end it at once should it still be importing."""
        try:
            os.close(self.pipe)
        except OSError:
            pass
        if self.alive():
            processes.end([psutil.Process(self.process.pid)])
        self.process.poll()  # its exit status, if processes.end did not reap it


#: Environment fingerprint -> its server, the one used last at the end.
_kept: dict[str, Kept] = {}
_at_exit = False


def key_for(cluster_env: dict[str, str]) -> str:
    """The name of the server this process keeps for ranks given ``cluster_env`` on top of
    this process's environment, started now if none runs (its ranks' stubs wait while it
    imports)."""
    env = {**os.environ, **cluster_env}
    found = fingerprint(env)
    kept = _kept.pop(found, None)
    if kept is not None and kept.alive():
        _kept[found] = kept  # the one used last goes at the end
        return kept.key
    idle = [name for name, other in _kept.items() if not other.serving()]
    while len(_kept) >= KEPT_MAX and idle:
        _kept.pop(idle.pop(0)).end()
    kept = _start(env)
    _kept[found] = kept
    return kept.key


def fingerprint(env: dict[str, str]) -> str:
    """What tells two environments apart for a server's imports: all but
    :data:`NOT_READ_ON_IMPORT`."""
    digest = hashlib.sha256()
    for name, value in sorted(env.items()):
        if not name.startswith(NOT_READ_ON_IMPORT):
            digest.update(f"{name}={value}\0".encode())
    return digest.hexdigest()


def _start(env: dict[str, str]) -> Kept:
    global _at_exit
    if not _at_exit:
        atexit.register(stop_all)
        _at_exit = True
    key = f"kept-{os.getpid()}-{secrets.token_hex(6)}"
    read_end, write_end = os.pipe()  # neither inherited by anything else this process starts
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", protocol.FORKSERVER_MODULE],
            env={**env, protocol.FORKSERVER_ENV: key,
                 protocol.FORKSERVER_OWNER_ENV: str(read_end)},
            pass_fds=[read_end], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)  # a Ctrl-C here is not its
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return Kept(key, process, write_end)


def running() -> list[int]:
    """The pids of the servers kept now."""
    return [kept.process.pid for kept in _kept.values() if kept.alive()]


def stop_all() -> None:
    """End every server this process keeps (their ranks, if any run, are not touched: each
    ends with its stub)."""
    while _kept:
        _kept.popitem()[1].end()
