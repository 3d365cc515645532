"""A cluster of test "hosts" on this one machine, for the multi-host tests (issue 14).

Each host is a set of Linux namespaces entered through one init process: its own network (an
``eth0`` on a private bridge), hostname (UTS), process tree (PID), mounts (a private ``/tmp`` and
``/dev/shm``) and SysV IPC, with a real ``sshd`` listening on its address. So ``mpiexec``'s
default ssh launch, hostname resolution and interface selection are what the tests exercise,
not a stand-in. The rest of the filesystem is shared, as a cluster's home directories are.

Why each part is there:

- A network namespace per host, joined by a bridge that lives in a namespace of its own: nothing
  is added to this machine's own network, and the hosts have no default route, so no packet
  leaves the machine. Addresses come from 198.51.100.0/24 (TEST-NET-2, RFC 5737: never routed).
- A UTS namespace, so ``hostname`` differs per host, and a per-namespace ``/etc/hosts``
  (``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``): in this
  machine's own namespace ``getfqdn()`` can be ``localhost``, which would send remote ranks to
  the wrong controller; inside a host it is the host's name, resolving to its address.
- A PID namespace, so "powering off" a host is one SIGKILL of its init (the kernel then kills
  everything in it) and a host's processes can be listed from here; and a private ``/tmp``
  because PRRTE names its session directories by pid only, and pids now repeat across hosts.
  Paths under ``/tmp`` that every host must see (the repository, the virtualenv, this cluster's
  own files) are bind-mounted back into each private ``/tmp``.
- A real sshd per host with keys made for this cluster. ``StrictModes no`` because the keys live
  under ``/tmp``; ``UsePAM no`` as there is no login session to set up. The client side is one
  ``ssh_config`` on a shared path that every host can use (PRRTE's daemons ssh onward, tree
  spawn), with a known_hosts pattern line so nothing ever prompts.

Clean-up is layered, because a test run that is interrupted must not leave namespaces behind:
``close()`` (the context manager's exit, also when the body raises), then an ``atexit`` hook and a
SIGTERM/SIGHUP handler; if this process is SIGKILLed, every host's init gets SIGKILL from the
kernel (parent-death signals) and the next cluster made on this machine removes the namespaces
and files that a dead process left (they are named ``ipydt-<pid>-...``).

Needs root, ``ip netns``, ``unshare``/``nsenter``/``setpriv`` (util-linux) and Debian's
openssh-server (``scripts/ensure-hosts.sh``). Only the standard library is imported, because the
same file is also each host's init program (``python netns_hosts.py init ...``).
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

#: Every namespace, /etc/netns entry and state directory this module makes starts with this.
PREFIX = "ipydt-"
#: TEST-NET-2 (RFC 5737): documentation addresses, never routed. 192.0.2.0/24 (TEST-NET-1) is
#: taken by some container networks, this machine's included.
DEFAULT_SUBNET = "198.51.100.0/24"
SUBNET_VAR = "IPYDIST_TEST_SUBNET"
SSHD = "/usr/sbin/sshd"
TOOLS = ("ip", "unshare", "nsenter", "setpriv", "ssh", "ssh-keygen")
#: How long one host may take to come up (its init starting sshd) before we give up.
START_TIMEOUT = 20.0


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "test hosts are network namespaces, which need root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    if missing:
        return f"missing {', '.join(missing)}: run scripts/ensure-hosts.sh as root"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Host:
    """One test host: its hostname, address and the names of its namespaces."""

    name: str
    address: str
    netns: str
    init: subprocess.Popen | None = field(default=None, repr=False)
    #: pids, in this machine's PID namespace, of the host's own processes (unshare, init, sshd)
    system: set[int] = field(default_factory=set, repr=False)
    init_pid: int | None = None
    ns_links: tuple[str, str] = ("", "")
    #: the host's private /tmp, as seen from here (PRRTE's session directories are in it)
    tmp: Path | None = None

    @property
    def on(self) -> bool:
        return self.init is not None and self.init.poll() is None


class HostProcess(subprocess.Popen):
    """A command running inside a host. ``self.pid`` is the ``nsenter`` that started it (in this
    machine's PID namespace); signals go to the command itself, which nsenter would not forward.
    The command gets SIGKILL if nsenter dies, so a killed handle leaves nothing running."""

    def inner_pid(self, wait: float = 1.0) -> int | None:
        """The command's pid in this machine's PID namespace (nsenter's one child)."""
        deadline = time.monotonic() + wait
        while True:
            kids = _children(self.pid)
            if kids or self.poll() is not None or time.monotonic() > deadline:
                return kids[0] if kids else None
            time.sleep(0.01)

    def send_signal(self, sig: int) -> None:
        inner = self.inner_pid() if self.poll() is None else None
        if inner is None:
            super().send_signal(sig)
            return
        try:
            os.kill(inner, sig)
        except ProcessLookupError:
            pass


class HostCluster:
    """``n`` compute hosts (``node1``...) and optionally a ``login`` host, as a context manager.

    ``with HostCluster(2) as hosts: hosts.run("login", ["ssh", "-F", hosts.ssh_config, "node1",
    "hostname"])``. Hosts are named by hostname in every method. ``timings`` holds the seconds
    bring-up (``up``) and teardown (``down``) took. ``link``: a ``shaped_links.Link`` that
    every host's eth0 sends through (default: none, memory speed).
    """

    _count = 0

    def __init__(self, n: int = 2, login: bool = True, subnet: str | None = None,
                 shared: tuple[str | os.PathLike, ...] = (), link=None):
        self.subnet = ipaddress.ip_network(subnet or os.environ.get(SUBNET_VAR) or DEFAULT_SUBNET)
        HostCluster._count += 1
        self.tag = f"{PREFIX}{os.getpid()}-{HostCluster._count}"
        addresses = self.subnet.hosts()
        for _ in range(9):  # .10 for login, .11... for nodes: easy to read in logs
            next(addresses)
        names = (["login"] if login else []) + [f"node{i}" for i in range(1, n + 1)]
        if not login:
            next(addresses)
        self._hosts = {name: Host(name, str(next(addresses)), f"{self.tag}-{name}")
                       for name in names}
        self.switch = self.tag  # the namespace that holds the bridge
        self._shared = [Path(p) for p in shared]
        self.state: Path | None = None
        self.timings: dict[str, float] = {}
        self._closed = False
        #: A ``shaped_links.Link`` for every host's eth0 (None: memory speed), and how it was
        #: shaped (``"netem"``: rate and delay; ``"tbf"``: rate only, no netem in the kernel).
        self.link = link
        self.shaped_with: str | None = None

    # -- what tests use -------------------------------------------------------------------

    @property
    def hosts(self) -> list[Host]:
        """The compute hosts (not the login host): where ranks run."""
        return [h for h in self._hosts.values() if h.name != "login"]

    @property
    def all_hosts(self) -> list[Host]:
        return list(self._hosts.values())

    def host(self, name: str) -> Host:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"no test host {name!r}; hosts: {', '.join(self._hosts)}") from None

    @property
    def ssh_config(self) -> Path:
        """The ssh client config every host can use (``ssh -F THIS HOST``): key, known hosts."""
        return self._path("ssh_config")

    @property
    def rsh_agent(self) -> str:
        """The command mpiexec's daemons are started with, on every host."""
        return f"ssh -F {self.ssh_config}"

    def hostfile(self, slots: int | dict[str, int] = 1, name: str = "hostfile") -> Path:
        """Write an OpenMPI hostfile (``node1 slots=2``) of the compute hosts on a shared path."""
        per = slots if isinstance(slots, dict) else {h.name: slots for h in self.hosts}
        path = self._path(name)
        path.write_text("".join(f"{h} slots={s}\n" for h, s in per.items()))
        return path

    def mpiexec_args(self) -> list[str]:
        """Open MPI 5 options that launch over this cluster's ssh and keep PRRTE's daemons and
        MPI's TCP traffic on the hosts' network (PRRTE otherwise advertises every interface)."""
        net = str(self.subnet)
        return [
            "--prtemca", "plm_ssh_agent", self.rsh_agent,
            "--prtemca", "prte_if_include", net,  # oob_tcp_if_include is its old name
            "--mca", "btl_tcp_if_include", net,
        ]

    def command(self, host: str, argv: list[str], cwd: str | os.PathLike | None = None,
                ) -> list[str]:
        """``argv`` prefixed so that it runs inside ``host`` (all of its namespaces)."""
        h = self._running(host)
        return ["nsenter", f"--target={h.init_pid}", "--net", "--uts", "--pid", "--mount",
                "--ipc", f"--wd={cwd or os.getcwd()}", "--",
                "setpriv", "--pdeathsig", "KILL", "--", *map(str, argv)]

    def popen(self, host: str, argv: list[str], cwd=None, **kw) -> HostProcess:
        """Start ``argv`` inside ``host``; keywords as for ``subprocess.Popen``."""
        return HostProcess(self.command(host, argv, cwd), **kw)

    def run(self, host: str, argv: list[str], *, input=None, timeout: float | None = None,
            check: bool = False, capture_output: bool = False, cwd=None,
            **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` to the end; keywords as for ``subprocess.run``."""
        if capture_output:
            kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kw["stdin"] = subprocess.PIPE
        with self.popen(host, argv, cwd=cwd, **kw) as proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def processes(self, host: str) -> dict[int, str]:
        """pid -> command line of what runs on ``host``, besides the host's own init and sshd
        (pids as seen from here; a command's ``nsenter`` counts, as it lives in the host)."""
        return self.all_processes()[host]

    def all_processes(self) -> dict[str, dict[int, str]]:
        """:meth:`processes` of every host, with one pass over /proc."""
        owner = {}
        for h in self._hosts.values():
            for link in h.ns_links:
                owner[link] = h.name
        found: dict[str, dict[int, str]] = {name: {} for name in self._hosts}
        system = set().union(*(h.system for h in self._hosts.values()))
        for pid in _pids():
            if pid in system:
                continue
            for kind in ("pid", "net"):
                name = owner.get(_ns_link(pid, kind))
                if name is not None:
                    cmd = _cmdline(pid)
                    if cmd is not None:
                        found[name][pid] = cmd
                    break
        return found

    def wait_no_processes(self, timeout: float = 10.0) -> dict[str, dict[int, str]]:
        """Wait until no host runs anything but its init and sshd; return what is still running
        after ``timeout`` (by host; empty when all is clean)."""
        deadline = time.monotonic() + timeout
        while True:
            left = {name: procs for name, procs in self.all_processes().items() if procs}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def kill_processes(self) -> None:
        """SIGKILL everything :meth:`all_processes` lists, so that the next test starts clean
        after one that left something running."""
        for procs in self.all_processes().values():
            for pid in procs:
                _kill(pid)

    def power_off(self, host: str) -> None:
        """Pull the plug on ``host``: SIGKILL its init, so the kernel kills all of its processes
        at once (no process gets to clean up). Its network stays, so peers see a dead host."""
        h = self.host(host)
        if h.on:
            os.kill(h.init_pid, signal.SIGKILL)
            h.init.wait(10)
        h.system.clear()

    # -- bring-up ---------------------------------------------------------------------------

    def __enter__(self) -> HostCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> HostCluster:
        """Make the hosts and start their sshd; on any failure, remove what was made."""
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot make test hosts: {reason}")
        t0 = time.monotonic()
        remove_stale()
        self._check_subnet_free()
        _live.add(self)
        _install_signal_handlers()
        try:
            self.state = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
            self._write_keys_and_configs()
            self._make_network()
            self._start_inits()
        except BaseException:
            self.close()
            raise
        self.timings["up"] = time.monotonic() - t0
        return self

    def _check_subnet_free(self) -> None:
        """Fail when this machine already uses our range: the hosts' traffic must not be
        mistaken for, or leak into, a real network."""
        out = _ip("-j", "addr", "show")
        for link in json.loads(out or "[]"):
            for a in link.get("addr_info", []):
                if a.get("family") != "inet":
                    continue
                net = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
                if net.overlaps(self.subnet):
                    raise RuntimeError(
                        f"the test hosts' range {self.subnet} is in use on this machine "
                        f"({link['ifname']} has {a['local']}/{a['prefixlen']}); set "
                        f"{SUBNET_VAR} to an unused private /24 for the multi-host tests")

    def _path(self, name: str) -> Path:
        if self.state is None:
            raise RuntimeError("the test hosts are not started (use `with HostCluster() as c`)")
        return self.state / name

    def _write_keys_and_configs(self) -> None:
        """A host key shared by all hosts, a client key, and the ssh/sshd configs."""
        for key in ("host_key", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.tag,
                            "-f", str(self._path(key))], check=True)
        host_pub = self._path("host_key.pub").read_text().split()[:2]
        names = [h.name for h in self.all_hosts] + [h.address for h in self.all_hosts]
        self._path("known_hosts").write_text(f"{','.join(names)} {' '.join(host_pub)}\n")
        shutil.copy(self._path("id_ed25519.pub"), self._path("authorized_keys"))
        self.ssh_config.write_text(_SSH_CONFIG.format(tag=self.tag, state=self.state))
        etc_hosts = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.all_hosts)
        for h in self.all_hosts:
            self._path(f"sshd_config.{h.name}").write_text(
                _SSHD_CONFIG.format(tag=self.tag, state=self.state, address=h.address))
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(etc_hosts)
            h.tmp = self.state / "hosts" / h.name / "tmp"
            h.tmp.mkdir(parents=True)

    def _make_network(self) -> None:
        """The switch namespace with a bridge, and one veth from it into each host."""
        _ip("netns", "add", self.switch)
        bridge = f"{PREFIX}br"  # names start with PREFIX, so a stray one is easy to find
        sw = [f"link add {bridge} type bridge", f"link set {bridge} up"]
        for h in self.all_hosts:
            _ip("netns", "add", h.netns)
            port = f"{PREFIX}p-{h.name}"[:15]
            sw += [f"link add {port} type veth peer name eth0 netns {h.netns}",
                   f"link set {port} master {bridge} up"]
        _ip("-n", self.switch, "-batch", "-", input="\n".join(sw))
        prefix = self.subnet.prefixlen
        for h in self.all_hosts:
            _ip("-n", h.netns, "-batch", "-", input="\n".join([
                "link set lo up", f"addr add {h.address}/{prefix} dev eth0", "link set eth0 up"]))
            if self.link is not None:
                from shaped_links import shape

                self.shaped_with = shape(h.netns, self.link)

    def _start_inits(self) -> None:
        """Start every host's init (which starts sshd) at once, then wait for all to be ready."""
        for h in self.all_hosts:
            h.init = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--", "ip", "netns", "exec", h.netns,
                 "unshare", "--uts", "--pid", "--mount", "--ipc", "--fork", "--mount-proc",
                 "--kill-child", "--", sys.executable, "-I", os.path.abspath(__file__), "init",
                 json.dumps(self._init_spec(h))],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=open(self._path(f"init.{h.name}.log"), "wb"), text=True)
        deadline = time.monotonic() + START_TIMEOUT
        for h in self.all_hosts:
            self._wait_ready(h, deadline)

    def _init_spec(self, h: Host) -> dict:
        keep = [Path(p) for p in (_repo_root(), os.getcwd(), sys.prefix, sys.base_prefix,
                                  self.state, *self._shared)]
        return {
            "hostname": h.name,
            "tmp": str(h.tmp),
            "keep": [str(p) for p in _under_tmp(keep)],
            "sshd": [SSHD, "-D", "-f", str(self._path(f"sshd_config.{h.name}")),
                     "-E", str(self._path(f"sshd.{h.name}.log"))],
        }

    def _wait_ready(self, h: Host, deadline: float) -> None:
        """Read the init's "ready" line; learn its pids and namespaces, as seen from here."""
        line = _readline(h.init.stdout, deadline - time.monotonic())
        if not line.startswith("ready"):
            log = self._path(f"init.{h.name}.log")
            sshd = self._path(f"sshd.{h.name}.log")
            said = line.strip() or f"nothing in {START_TIMEOUT:.0f} s"
            raise RuntimeError(f"test host {h.name} did not come up (its init said {said!r}); "
                               f"init log:\n{_tail(log)}\nsshd log:\n{_tail(sshd)}")
        kids = _children(h.init.pid)
        h.init_pid = kids[0]
        h.system = {h.init.pid, h.init_pid, *_children(h.init_pid)}
        h.ns_links = (_ns_link(h.init_pid, "pid"), _ns_link(h.init_pid, "net"))

    def _running(self, host: str) -> Host:
        h = self.host(host)
        if not h.on:
            raise RuntimeError(f"test host {host} is not running (powered off or closed)")
        return h

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host (all its processes), delete the namespaces, /etc/netns entries and
        state files. Idempotent; tries every step and then raises if any failed."""
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        problems = []
        for h in self.all_hosts:
            if h.on:
                _kill(h.init_pid)
                h.init.kill()  # unshare: its child, the init, gets SIGKILL with it
        for h in self.all_hosts:
            if h.init is not None:
                try:
                    h.init.wait(10)
                    h.init.stdout.close()
                except subprocess.TimeoutExpired:
                    problems.append(f"{h.name}'s init did not exit after SIGKILL")
            # unshare (h.init) can end before the host's init has: the kernel kills the rest
            # of the host's processes as its init exits, and its exit ends only once they are
            # gone (its sshd was once still listed just after unshare had ended)
            deadline = time.monotonic() + 10
            while h.init_pid is not None and _cmdline(h.init_pid) is not None:
                if time.monotonic() > deadline:
                    problems.append(f"{h.name}'s processes did not end within 10 s of SIGKILL")
                    break
                time.sleep(0.01)
            h.system.clear()
        for ns in [h.netns for h in self.all_hosts] + [self.switch]:
            problems += _remove_netns(ns)
        if self.state is not None:
            shutil.rmtree(self.state, ignore_errors=True)
        _live.discard(self)
        self.timings["down"] = time.monotonic() - t0
        if problems:
            raise RuntimeError("test hosts not fully removed: " + "; ".join(problems))


_SSH_CONFIG = """\
# The test hosts' ssh client config (tests/harness/netns_hosts.py, cluster {tag}):
# `ssh -F THIS HOST`.
Host *
    User root
    IdentityFile {state}/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile {state}/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    UpdateHostKeys no
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
"""

_SSHD_CONFIG = """\
# sshd of one test host (tests/harness/netns_hosts.py, cluster {tag})
ListenAddress {address}
Port 22
HostKey {state}/host_key
AuthorizedKeysFile {state}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
# the keys live under /tmp, which is world-writable
StrictModes no
UsePAM no
UseDNS no
PrintMotd no
PrintLastLog no
PidFile none
MaxStartups 100
MaxSessions 100
LogLevel INFO
"""


# -- cleaning up after this process and after dead ones ---------------------------------------

_live: weakref.WeakSet[HostCluster] = weakref.WeakSet()


def _close_all() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception as e:  # at exit or in a signal handler: report, do not stop
            print(f"netns_hosts: {e}", file=sys.stderr)


atexit.register(_close_all)


def _install_signal_handlers() -> None:
    """On SIGTERM/SIGHUP (where nobody else handles them), remove the hosts, then die of the
    signal as before. Only from the main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _on_signal)


def _on_signal(sig: int, frame) -> None:
    _close_all()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def remove_stale() -> list[str]:
    """Remove namespaces, /etc/netns entries and state directories left by a process that died
    (its pid is in their names: ``ipydt-<pid>-...``); never those of a live process."""
    removed = []
    out = _ip("netns", "list")
    names = {line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)}
    etc = Path("/etc/netns")
    if etc.is_dir():
        names |= {p.name for p in etc.iterdir() if p.name.startswith(PREFIX)}
    for ns in sorted(names):
        if not _owner_alive(ns):
            _remove_netns(ns)
            removed.append(ns)
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        if d.is_dir() and not _owner_alive(d.name):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def leftovers(tag: str = PREFIX) -> list[str]:
    """What this module made that still exists, for one cluster (its ``tag``) or all of them:
    namespaces, /etc/netns entries, links in this machine's namespace, state directories, and
    processes (a host's init or sshd names the cluster's state directory)."""
    found = [f"netns {line.split()[0]}" for line in _ip("netns", "list").splitlines()
             if line.startswith(tag)]
    etc = Path("/etc/netns")
    if etc.is_dir():
        found += [f"/etc/netns/{p.name}" for p in etc.iterdir() if p.name.startswith(tag)]
    # interface names are cut to 15 characters: match what the tag's start allows
    found += [f"link {link['ifname']}" for link in json.loads(_ip("-j", "link", "show") or "[]")
              if link["ifname"].startswith(PREFIX)]
    found += [str(d) for d in Path(tempfile.gettempdir()).glob(f"{tag}*")]
    me = os.getpid()
    found += [f"process {pid}: {cmd}" for pid in _pids() if pid != me
              for cmd in [_cmdline(pid)] if cmd and f"/{tag}" in cmd]
    return found


def _owner_alive(name: str) -> bool:
    """Whether the process named in ``ipydt-<pid>-...`` runs (unparsable names count as alive,
    so that we never remove what we did not make)."""
    try:
        pid = int(name[len(PREFIX):].split("-")[0])
    except ValueError:
        return True
    return Path(f"/proc/{pid}").exists()


def _remove_netns(ns: str) -> list[str]:
    """SIGKILL whatever still runs in ``ns``, delete it and its /etc/netns entry."""
    problems = []
    path = Path("/run/netns") / ns
    if path.exists():
        try:
            link = f"net:[{path.stat().st_ino}]"
        except OSError:
            link = None
        for pid in _pids():
            if link and _ns_link(pid, "net") == link:
                _kill(pid)
        done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        if done.returncode != 0 and path.exists():
            problems.append(f"ip netns del {ns}: {done.stderr.strip()}")
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    return problems


# -- small helpers ---------------------------------------------------------------------------


def _ip(*args: str, input: str | None = None) -> str:
    done = subprocess.run(["ip", *args], input=input, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _kill(pid: int | None) -> None:
    """SIGKILL ``pid`` if it is still there."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _ns_link(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _cmdline(pid: int) -> str | None:
    """The command line of a live process; None for a zombie or a process that is gone. A
    process in the middle of an exec shows an empty command line for a moment: it is alive,
    and named by its executable's name until its new one shows."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        if raw:
            return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:][:1]
    return None if state in ("Z", "X") else f"[{name}]"


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _readline(stream, timeout: float) -> str:
    """One line from a pipe, or '' after ``timeout`` seconds or at end of file."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(max(timeout, 0)):
            return ""
    return stream.readline()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _under_tmp(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` under /tmp, without any that another one contains: what each host must
    bind back into its private /tmp."""
    tmp = Path("/tmp").resolve()
    resolved = sorted({Path(os.path.realpath(p)) for p in paths})
    out: list[Path] = []
    for p in resolved:
        if p != tmp and p.is_relative_to(tmp) and not any(p.is_relative_to(q) for q in out):
            out.append(p)
    return out


# -- each host's init: runs as PID 1 inside the host's namespaces -----------------------------


def _init_main(spec: dict) -> None:
    """Set the hostname, give the host a private /tmp (with the shared paths under /tmp bound
    back in) and /dev/shm, start sshd, say "ready" when it listens, then reap orphans forever
    (PID 1's job) until the host is powered off by SIGKILL."""
    import socket

    socket.sethostname(spec["hostname"])
    tmp = spec["tmp"]
    for keep in spec["keep"]:
        inside = os.path.join(tmp, os.path.relpath(keep, "/tmp"))
        os.makedirs(inside, exist_ok=True)
        _mount("--bind", keep, inside)
    _mount("--rbind", tmp, "/tmp")
    _mount("-t", "tmpfs", "-o", "mode=1777,size=1g", "tmpfs", "/dev/shm")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    sshd = subprocess.Popen(spec["sshd"], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT
    while not _listening(22):
        if sshd.poll() is not None or time.monotonic() > deadline:
            print(f"sshd did not start (exit status {sshd.poll()})", flush=True)
            sys.exit(1)
        time.sleep(0.01)
    print("ready", flush=True)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _listening(port: int) -> bool:
    """Whether something listens on TCP ``port`` in this network namespace."""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                return True
    return False


if __name__ == "__main__" and sys.argv[1:2] == ["init"]:
    _init_main(json.loads(sys.argv[2]))
