"""A real Slurm cluster on the test hosts of tests/harness/netns_hosts.py, for the Slurm tests
(issue 14).

Debian's Slurm (``slurmctld``, ``slurmd``, ``slurmstepd`` and the clients, 22.05 on bookworm)
runs the way it runs on a cluster: ``slurmctld`` on the ``login`` host, one ``slurmd`` on each
node host, each inside its host's namespaces, so every node has its own hostname and address and
the nodes' ranks really are on other hosts. Commands (``srun``, ``sbatch``, ``salloc``,
``squeue``...) run on the login host, as a notebook kernel there would run them::

    with SlurmCluster(nodes=2) as slurm:
        slurm.run(["srun", "-N2", "-n4", "hostname"])            # on the login host
        slurm.hosts.run("login", [...], env=slurm.env())          # any command, same thing

A process on the login host needs only ``SLURM_CONF`` (see :meth:`SlurmCluster.env`); the
configuration file is on a path every host sees (this cluster's directory in the hosts' shared
state directory).

Choices, and why:

- ``AuthType=auth/none`` and ``CredType=cred/none``: no munged to run (it refuses a socket under
  a 0700 parent, and would be one more daemon per host); the hosts' network is private.
- No cgroups: ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, no accounting.
  Each host's ``/sys`` is the fresh sysfs that ``ip netns exec`` mounts, without the cgroup file
  system, and nothing here runs systemd. slurmd 22.05 loads a cgroup plugin all the same, and its
  autodetection fails there ("No filesystem mounted on /sys/fs/cgroup"): a ``cgroup.conf`` next
  to slurm.conf names the plugin, which then loads without looking and is never asked for a
  cgroup. So the daemons run inside the hosts as they are (their ``popen``), with no remount.
- ``SlurmdParameters=config_overrides`` with ``CPUs=`` per node: a node offers that many slots
  whatever this machine has (else a node with more slots than cores is INVALID).
- Each host has a private ``/tmp`` already, so Slurm's PMIx scratch directories (keyed by job id
  under ``TmpFS``) do not collide across nodes.
- ``MpiDefault=none``: an MPI program asks for ``srun --mpi=pmix`` (or ``SLURM_MPI_TYPE=pmix``);
  with ``pmix`` as the default, MPICH programs abort.
- Daemons run in the foreground (``-D``) under the hosts' ``popen``; the slurmds start once
  slurmctld listens, so they register at once, and bring-up ends when ``sinfo`` shows every node
  ``idle``. ``batch_sched_delay=0``: a batch job is scheduled when submitted (within about 1 s,
  slurmctld's background tick), not up to 3 s later; the first one after bring-up still waits
  about 3 s for slurmctld's first scheduling pass.

Clean-up: :meth:`SlurmCluster.close` (the context's exit, also when the body raises) cancels every
job, stops the daemons and kills whatever still carries this cluster's ``SLURM_CONF`` (job steps,
ranks, ``salloc`` shells); everything lives in the hosts' PID namespaces, so when the hosts go
(their own clean-up, which also runs at exit, on SIGTERM, and through the kernel when this
process is SIGKILLed), nothing of Slurm's can outlive them.

Needs root, ``ip netns`` and Debian's Slurm packages with ``libpmix2``/``libpmix-dev``
(``scripts/ensure-slurm.sh``, after ``scripts/ensure-hosts.sh``).
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import netns_hosts
from netns_hosts import HostCluster, HostProcess

SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
SLURMSTEPD = "/usr/sbin/slurmstepd"
CLIENTS = ("srun", "sbatch", "salloc", "squeue", "sinfo", "scancel", "scontrol")
#: The unversioned library that Slurm's mpi/pmix plugin dlopens (from libpmix-dev).
PMIX_LIBS = ("/usr/lib/*/pmix2/lib/libpmix.so", "/usr/lib/*/libpmix.so", "/usr/lib/libpmix.so")
CTLD_PORT = 6817
SLURMD_PORT = 6818
#: Variables of an outer Slurm job (a CI runner inside an allocation) that would make our
#: clients believe they are inside one of this cluster's jobs.
OUTER_VARS = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_")
#: How long bring-up may take: slurmctld listening, then every node idle.
START_TIMEOUT = 30.0


def unavailable() -> str | None:
    """Why a Slurm cluster cannot be made here (a skip reason), or None when it can."""
    reason = netns_hosts.unavailable()
    if reason:
        return reason
    missing = [p for p in (SLURMCTLD, SLURMD, SLURMSTEPD) if not os.access(p, os.X_OK)]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    if not any(glob.glob(p) for p in PMIX_LIBS):
        missing.append("libpmix.so (libpmix-dev)")
    if missing:
        return f"missing {', '.join(missing)}: run scripts/ensure-slurm.sh as root"
    return None


class SlurmCluster:
    """slurmctld on the login host and one slurmd on each of ``nodes`` node hosts.

    ``hosts``: an existing :class:`HostCluster` (with a login host) to run on; by default the
    cluster makes its own (``nodes`` nodes) and removes it on exit. ``cpus``: the slots of each
    node. ``timings`` holds the seconds that bring-up (``hosts_up``, ``slurm_up``, ``up``) and
    teardown (``down``) took.
    """

    def __init__(self, nodes: int = 2, *, hosts: HostCluster | None = None, cpus: int = 2,
                 partition: str = "debug", mpi_default: str = "none"):
        self._own_hosts = hosts is None
        self.hosts = hosts if hosts is not None else HostCluster(nodes, login=True)
        self.cpus = cpus
        self.partition = partition
        self.mpi_default = mpi_default
        self.dir: Path | None = None
        self.timings: dict[str, float] = {}
        self._ctld: HostProcess | None = None
        self._slurmds: dict[str, HostProcess] = {}
        self._closed = False

    # -- what tests use -----------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        """The node names (also their hostnames): ``node1``, ``node2``..."""
        return [h.name for h in self.hosts.hosts]

    @property
    def login(self) -> str:
        """The host that runs slurmctld and from which jobs are submitted."""
        return "login"

    @property
    def conf(self) -> Path:
        """slurm.conf, on a path that every host sees."""
        return self._path("slurm.conf")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm commands on the login host: this process's, without any
        outer Slurm job's variables, with ``SLURM_CONF`` naming this cluster's slurm.conf."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(OUTER_VARS)}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run on the login host (give it :meth:`env`)."""
        return self.hosts.command(self.login, argv)

    def run(self, argv: list[str], *, timeout: float = 60, check: bool = False,
            env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` (``["srun", ...]``, ``["salloc", ...]``...) on the login host with
        :meth:`env` (plus ``env``), in a session of its own; text output captured. The working
        directory is this cluster's (shared) directory unless ``cwd`` says otherwise, so that
        sbatch's default ``slurm-JOB.out`` files go away with the cluster. On timeout the whole
        process group gets SIGKILL (``salloc`` ignores SIGTERM) and TimeoutExpired is raised;
        the job it held is cancelled by the per-test check or :meth:`close`."""
        proc = self.hosts.popen(self.login, argv, cwd=cwd or self._path("jobs"),
                                env=self.env(**(env or {})),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        with proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, argv))} exited {done.returncode}:\n"
                               f"{out}\n{err}")
        return done

    def srun(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run(["srun", *args], timeout=timeout)

    def salloc(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.run(["salloc", *args], timeout=timeout)

    def sbatch(self, *args: str) -> str:
        """Submit a batch job (``sbatch --parsable ARGS``); its job id."""
        return self.run(["sbatch", "--parsable", *args], check=True).stdout.strip().split(";")[0]

    def jobs(self) -> list[str]:
        """The ids of the jobs slurmctld knows that are not finished."""
        done = self.run(["squeue", "-h", "-o", "%A"], check=True, timeout=20)
        return done.stdout.split()

    def node_states(self) -> dict[str, str]:
        """node name -> state as ``sinfo`` says (``idle``, ``alloc``, ``mixed``, ``down*``...)."""
        done = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=True, timeout=20)
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def wait_job_done(self, job: str, timeout: float = 60) -> None:
        """Wait until ``job`` is no longer pending or running."""
        deadline = time.monotonic() + timeout
        while job in self.jobs():
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still in squeue after {timeout:.0f} s")
            time.sleep(0.1)

    def daemon_pids(self) -> set[int]:
        """pids (as seen from here) of slurmctld, the slurmds and the nsenter of each."""
        pids: set[int] = set()
        parents = _parents()
        for proc in [self._ctld, *self._slurmds.values()]:
            if proc is not None and proc.poll() is None:
                pids.add(proc.pid)
                # slurmctld's slurmscriptd; not a job step, should slurmd not daemonize one
                pids.update(_descendants(proc.pid, parents, stop="slurmstepd"))
        return pids

    def job_processes(self) -> dict[str, dict[int, str]]:
        """What runs on each host besides the hosts' own processes and Slurm's daemons (job
        steps, ranks, salloc and its shell...): host -> pid -> command line."""
        daemons = self.daemon_pids()
        return {name: {pid: cmd for pid, cmd in procs.items() if pid not in daemons}
                for name, procs in self.hosts.all_processes().items()}

    def wait_quiet(self, timeout: float = 10) -> tuple[list[str], dict[str, dict[int, str]]]:
        """Wait until no job is in squeue and no job process is on any host; return what is
        still there after ``timeout`` (job ids, and processes by host; both empty when quiet)."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs()
            procs = {h: p for h, p in self.job_processes().items() if p}
            if (not jobs and not procs) or time.monotonic() > deadline:
                return jobs, procs
            time.sleep(0.1)

    def cancel_all(self) -> None:
        """scancel every job, then SIGKILL any job process still on a host."""
        jobs = self.jobs()
        if jobs:
            self.run(["scancel", *jobs], timeout=20)
        self.wait_quiet(5)
        for procs in self.job_processes().values():
            for pid in procs:
                _kill(pid)

    # -- bring-up -----------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> SlurmCluster:
        """Make the hosts (unless given), write slurm.conf, start slurmctld then the slurmds,
        and wait until every node is idle; on any failure, remove what was made."""
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot make a Slurm cluster: {reason}")
        t0 = time.monotonic()
        try:
            if self._own_hosts:
                self.hosts.start()
            elif not self.hosts.host(self.login).on:
                raise RuntimeError("the hosts' login host is not running")
            self.timings["hosts_up"] = time.monotonic() - t0
            t1 = time.monotonic()
            (self.hosts.state / "slurm").mkdir()  # fails if another cluster uses these hosts
            self.dir = self.hosts.state / "slurm"
            self._write_conf()
            self._start_ctld()
            for node in self.nodes:
                self._slurmds[node] = self._daemon(node, [SLURMD, "-D", "-f", str(self.conf),
                                                          "-N", node], f"slurmd.{node}")
            self._wait_idle(time.monotonic() + START_TIMEOUT)
            self.timings["slurm_up"] = time.monotonic() - t1
        except BaseException:
            self.close()
            raise
        self.timings["up"] = time.monotonic() - t0
        return self

    def _path(self, name: str) -> Path:
        if self.dir is None:
            raise RuntimeError("the Slurm cluster is not started (`with SlurmCluster() as c`)")
        return self.dir / name

    def _write_conf(self) -> None:
        for sub in ["ctld", "jobs", *(f"spool/{n}" for n in self.nodes)]:
            (self.dir / sub).mkdir(parents=True)
        login = self.hosts.host(self.login)
        nodes = "".join(
            f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs={self.cpus} "
            "State=UNKNOWN\n" for h in self.hosts.hosts)
        self.conf.write_text(_SLURM_CONF.format(
            tag=self.hosts.tag, dir=self.dir, login=login.name, login_addr=login.address,
            ctld_port=CTLD_PORT, slurmd_port=SLURMD_PORT, mpi=self.mpi_default, nodes=nodes,
            partition=self.partition, node_list=",".join(self.nodes)))
        self._path("cgroup.conf").write_text(_CGROUP_CONF.format(tag=self.hosts.tag))

    def _daemon(self, host: str, argv: list[str], name: str) -> HostProcess:
        """Start a daemon in the foreground inside ``host``; its output goes to NAME.out. It
        gets this cluster's SLURM_CONF, which marks it, and all it starts, as ours."""
        with open(self._path(f"{name}.out"), "wb") as out:
            return self.hosts.popen(host, argv, env=self.env(), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)

    def _start_ctld(self) -> None:
        self._ctld = self._daemon(self.login, [SLURMCTLD, "-D", "-f", str(self.conf)],
                                  "slurmctld")
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            inner = self._ctld.inner_pid(0.1)
            if inner is not None and _listening(inner, CTLD_PORT):
                return
            if self._ctld.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"slurmctld did not start (exit status {self._ctld.poll()}):"
                                   f"\n{self._logs()}")
            time.sleep(0.01)

    def _wait_idle(self, deadline: float) -> None:
        states: dict[str, str] = {}
        while True:
            dead = [name for name, p in [("slurmctld", self._ctld), *self._slurmds.items()]
                    if p.poll() is not None]
            if not dead:
                states = self.node_states()
                if all(states.get(n) == "idle" for n in self.nodes):
                    return
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"node states {states}"
                raise RuntimeError(f"the Slurm cluster did not come up ({why}):\n{self._logs()}")
            time.sleep(0.05)

    def _logs(self) -> str:
        names = ["slurmctld", *(f"slurmd.{n}" for n in self.nodes)]
        return "\n".join(f"--- {n}:\n{netns_hosts._tail(self._path(n + '.out'))}"
                         for n in names if self._path(n + ".out").exists())

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every job, stop the daemons, kill what is left of ours on every host, and
        remove the hosts (when this cluster made them) or this cluster's files. Idempotent;
        tries every step and then raises if any failed."""
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        problems: list[str] = []
        try:
            if self._ctld is not None and self._ctld.poll() is None:
                try:
                    self.cancel_all()
                except Exception as e:  # go on: the daemons and hosts must still go
                    problems.append(f"cancelling the jobs: {e}")
            for proc in [*self._slurmds.values(), self._ctld]:
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            for proc in [*self._slurmds.values(), self._ctld]:
                if proc is None:
                    continue
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            if self.dir is not None:
                left = self._kill_ours()
                if left:
                    problems.append(f"processes of this Slurm cluster left: {left}")
        finally:
            try:
                if self._own_hosts:
                    self.hosts.close()
                elif self.dir is not None:
                    shutil.rmtree(self.dir, ignore_errors=True)
            finally:
                self.timings["down"] = time.monotonic() - t0
        if problems:
            raise RuntimeError("Slurm cluster not fully removed: " + "; ".join(problems))

    def _kill_ours(self) -> list[str]:
        """SIGKILL every process on this machine that carries this cluster's SLURM_CONF, and
        their descendants (slurmstepd, ranks, salloc's shell); what is still alive after 5 s."""
        for pid in leftovers_pids(self.conf):
            _kill(pid)
        deadline = time.monotonic() + 5
        while (left := leftovers_pids(self.conf)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [f"{pid}: {netns_hosts._cmdline(pid)}" for pid in left]


_SLURM_CONF = """\
# A test Slurm cluster (tests/harness/slurm_cluster.py, hosts {tag}): slurmctld on {login}, one
# slurmd per node host. No munge, no cgroups, no accounting: see the module's docstring.
ClusterName=ipydt
MailProg=/bin/true
SlurmctldHost={login}({login_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault={mpi}
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# a batch job (sbatch) is scheduled when submitted, not up to 3 s later
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
ReturnToService=2
# short waits: a cancelled step gets SIGKILL 2 s after SIGTERM; finished jobs leave slurmctld
# after 2 s
KillWait=2
MinJobAge=2
InactiveLimit=0
SlurmdTimeout=30
MessageTimeout=10
TmpFS=/tmp
{nodes}PartitionName={partition} Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""

#: Next to slurm.conf, where Slurm looks for it: see "No cgroups" in the module's docstring.
_CGROUP_CONF = """\
# tests/harness/slurm_cluster.py, hosts {tag}: see slurm.conf
CgroupPlugin=cgroup/v1
"""


# -- helpers ----------------------------------------------------------------------------------


def leftovers_pids(conf: str | os.PathLike) -> list[int]:
    """pids of processes on this machine whose environment names ``conf`` as SLURM_CONF (the
    daemons, and every job process they or a client started), with their descendants."""
    mark = f"SLURM_CONF={conf}".encode()
    me = os.getpid()
    marked = set()
    for pid in netns_hosts._pids():
        if pid == me:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if mark in env.split(b"\0"):
            marked.add(pid)
    parents = _parents()
    for pid in list(marked):
        marked.update(_descendants(pid, parents))
    return sorted(p for p in marked if netns_hosts._cmdline(p) is not None)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc/PID/stat: a multi-threaded daemon's
    children are not all in its main thread's ``children`` file)."""
    parents = {}
    for pid in netns_hosts._pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _descendants(pid: int, parents: dict[int, int] | None = None,
                 stop: str | None = None) -> set[int]:
    """The descendants of ``pid``; with ``stop``, not those of (nor) a process whose command
    line starts with ``stop``."""
    if parents is None:
        parents = _parents()
    kids: dict[int, list[int]] = {}
    for child, parent in parents.items():
        kids.setdefault(parent, []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for kid in kids.get(todo.pop(), []):
            if kid in found:
                continue
            if stop is not None and (netns_hosts._cmdline(kid) or "").startswith(stop):
                continue
            found.add(kid)
            todo.append(kid)
    return found


def _listening(pid: int, port: int) -> bool:
    """Whether something listens on TCP ``port`` in the network namespace of ``pid``."""
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
