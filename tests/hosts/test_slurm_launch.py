"""``%dist_start --launcher slurm`` against a real slurmctld and two slurmds
(tests/harness/slurm_cluster.py). From a login host, ``salloc`` asks for a new allocation and
``srun`` starts the ranks in it; inside an allocation, ``srun`` starts them in that one. A cell runs
and trains on ranks on both node hosts; a rank killed on a node is named with its host, and a
restart asks for a new job; the job and every process go when the cluster stops, or when the
notebook side is killed; a job that waits in the queue past ``--timeout`` is cancelled, with
Slurm's reason (issue 14).

Each test runs a short program on the login host -- the notebook side, a ``Session`` -- which
prints one JSON line of what it saw.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from lab_server import write_server_config
from slurm_cluster import SlurmCluster, unavailable

REASON = unavailable()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

#: Ranks train a small model with DistributedOptimizer on data that differs per rank; every
#: rank must end with the same parameters, equal to one model trained on all the data.
TRAIN = """
import torch, ipydist.torch as hvd
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(hvd.rank())
x = torch.randn(16, 3, generator=g)
y = x.sum(dim=1, keepdim=True)
losses = []
for step in range(20):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
"""


@pytest.fixture(scope="module")
def slurm_cluster():
    with SlurmCluster(nodes=2) as c:
        yield c


@pytest.fixture
def slurm(slurm_cluster):
    """After each test: no job in squeue, nothing but the daemons on any host, within 10 s."""
    yield slurm_cluster
    jobs, procs = slurm_cluster.wait_quiet(10)
    if jobs or procs:
        slurm_cluster.cancel_all()
    assert (jobs, procs) == ([], {}), f"left 10 s after the test: jobs {jobs}, processes {procs}"


def program(session_args: str, body: str) -> str:
    return "\n".join([
        "import json, sys",
        "from ipydist import Session",
        "out = {}",
        f"TRAIN = {TRAIN!r}",
        f"SUM = {SUM!r}",
        f"session = Session({session_args})",
        "try:",
        "    session.start()",
        textwrap.indent(textwrap.dedent(body).strip("\n"), "    "),
        "finally:",
        "    session.stop(quiet=True)",
        "print('RESULT ' + json.dumps(out), flush=True)",
    ])


def notebook_side(c: SlurmCluster, argv_prefix: list[str], code: str,
                  timeout: float = 240) -> dict:
    done = c.run([*argv_prefix, sys.executable, "-c", code], timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-12000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "_stdout": done.stdout,
            "_stderr": done.stderr}


TRAIN_BODY = """
out["hosts"] = [r["host"] for r in session.ranks]
out["local"] = [r["local_rank"] for r in session.ranks]
out["job"] = session.cluster.slurm_job
import subprocess
out["squeue"] = subprocess.run(["squeue", "-h", "-o", "%A %j %T"], capture_output=True,
                               text=True).stdout.split()
session.run(TRAIN, output="rank0")
out["params"] = session.pull("params")
out["losses"] = session.pull("losses", rank=0)
out["total"] = session.pull("total")
"""


SUM = "import torch, ipydist.torch as hvd; s = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()"


def check_training(out: dict) -> None:
    assert out["hosts"] == ["node1", "node1", "node2", "node2"], out["hosts"]
    assert out["local"] == [0, 1, 0, 1]
    first = out["params"][0]
    assert all(p == pytest.approx(first, abs=1e-6) for p in out["params"]), out["params"]
    assert out["losses"][-1] < out["losses"][0] / 2, out["losses"]
    assert out["total"] == [6.0] * 4


def test_launcher_slurm_from_a_login_host_allocates_and_trains(slurm):
    t0 = time.monotonic()
    out = notebook_side(slurm, [], program(
        "np=4, launcher='slurm', partition='debug', time_limit='5', timeout=120", TRAIN_BODY))
    print(f"\nipydist-measure: slurm salloc start+train+stop {time.monotonic() - t0:.2f} s")
    check_training(out)
    assert out["job"] and out["squeue"] == [out["job"], "ipydist", "RUNNING"], out["squeue"]
    assert "4 ranks on 2 hosts ready" in out["_stdout"], out["_stdout"]
    # the start line (on stderr outside a notebook) named the launch and the job
    assert "with Slurm (salloc, then srun) · " in out["_stderr"], out["_stderr"]
    assert f"salloc launched · Slurm job {out['job']} granted" in out["_stderr"]


def test_launcher_slurm_inside_an_allocation_uses_srun_in_it(slurm):
    out = notebook_side(slurm, ["salloc", "-N2", "-n4"], program(
        "launcher='slurm', timeout=120", TRAIN_BODY))
    check_training(out)
    # no new job: the ranks are a step of the allocation the program runs in
    assert len(out["squeue"]) == 3 and out["squeue"][1] != "ipydist", out["squeue"]
    assert out["job"] is None


#: Rank 3 (on node2) SIGKILLed through ipyparallel's nanny, which may land after a quick cell
#: ended: cells that take a moment, until one meets the death (or 10 s); ``t0`` and
#: ``out["error"]`` are set.
KILL_RANK_3 = """
import signal, time
session.signal(signal.SIGKILL, ranks=[3])
t0 = time.monotonic()
while "error" not in out and time.monotonic() - t0 < 10:
    try:
        session.run("import time; time.sleep(0.5)", timeout=30)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
"""


# Back in make test (issue 46): it had failed as "Engine 0 died while running task" (healthy
# survivors declared dead by a 4 s heartbeat, now 20 s; see notebook.cluster) and left a rank
# on node1 (now ended by bootstrap.end_with_launcher). Since: 10 of 10 quiet, 5 of 5 under 2
# CPU hogs.
def test_inside_an_allocation_mpiexec_heals_a_rank_killed_on_a_node(slurm):
    """srun cannot replace a rank (``--launcher slurm --elastic`` is refused, saying this):
    inside an allocation ``--launcher mpiexec`` starts Open MPI's daemons through Slurm, on
    the allocation's nodes, and a rank killed on the second node is replaced there."""
    body = textwrap.dedent("""
        session.run(SUM + "\\nkept = 'before'")
        before = [r["pid"] for r in session.ranks]
    """) + KILL_RANK_3 + textwrap.dedent("""
        session.run(SUM)
        out["healed"] = time.monotonic() - t0
        out["sums"] = session.pull("s")
        out["kept"] = session.pull("kept")
        out["hosts"] = [r["host"] for r in session.ranks]
        out["survivors"] = [r["pid"] for r in session.ranks][:3] == before[:3]
    """)
    out = notebook_side(slurm, ["salloc", "-N2", "-n4"], program("timeout=120", body))
    print(f"\nipydist-measure: slurm allocation, mpiexec: healed and a cell done "
          f"{out['healed']:.2f} s after the kill")
    assert out["error"].startswith("RankDied: rank 3 (pid ") and "being replaced" in \
        out["error"], out["error"]
    assert out["sums"] == [4.0] * 4 and out["kept"] == ["before"] * 4, out
    assert out["hosts"] == ["node1", "node1", "node2", "node2"] and out["survivors"], out


def test_a_rank_killed_on_a_node_is_reported_with_its_host_and_a_restart_works(slurm):
    body = textwrap.dedent("""
        first_job = session.cluster.slurm_job
    """) + KILL_RANK_3 + textwrap.dedent("""
        out["seconds"] = time.monotonic() - t0
        session.restart()
        out["jobs"] = [first_job, session.cluster.slurm_job]
        session.run(SUM)
        out["sums"] = session.pull("s")
    """)
    out = notebook_side(slurm, [], program("np=4, launcher='slurm', timeout=120", body))
    print(f"\nipydist-measure: slurm rank death reported in {out['seconds']:.2f} s")
    assert out["error"].startswith("RankDied: rank 3 (pid "), out["error"]
    assert " on node2) died: killed by signal 9 (SIGKILL)" in out["error"], out["error"]
    assert out["seconds"] < 5, out
    assert out["jobs"][0] != out["jobs"][1], "the restart asked for a new allocation"
    assert out["sums"] == [4.0] * 4


def test_killing_the_notebook_side_ends_the_job_and_its_ranks(slurm):
    code = program("np=4, launcher='slurm', timeout=120", """
        print("READY", session.cluster.slurm_job, flush=True)
        import time
        time.sleep(600)
    """)
    proc = slurm.hosts.popen(slurm.login, [sys.executable, "-c", code], env=slurm.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("READY"):
                break
        assert seen and seen[-1].startswith("READY"), "".join(seen)
        assert slurm.jobs(), "the cluster's job is not in squeue"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        jobs, procs = slurm.wait_quiet(10)
        print(f"\nipydist-measure: slurm quiet after SIGKILL {time.monotonic() - t0:.2f} s")
        assert (jobs, procs) == ([], {}), f"10 s after SIGKILL: jobs {jobs}, processes {procs}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_a_job_that_waits_in_the_queue_past_the_timeout_is_cancelled_and_says_why(slurm):
    out = notebook_side(slurm, [], textwrap.dedent("""
        import json, time
        from ipydist import Session
        out = {}
        t0 = time.monotonic()
        try:
            Session(np=64, launcher="slurm", timeout=5).start()
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - t0
        try:
            Session(np=2, launcher="slurm", partition="nosuch").start()
        except Exception as e:
            out["partition"] = f"{type(e).__name__}: {e}"
        print("RESULT " + json.dumps(out))
    """))
    error = out["error"]
    assert error.startswith("ClusterError: only 0 of 64 ranks started within --timeout 5 s; "
                            "by then: salloc launched · Slurm job "), error
    assert "pending (waiting for nodes)" in error and "still waits for nodes (squeue's " in error
    assert "it is cancelled" in error
    assert out["seconds"] < 20, out
    assert out["partition"].startswith("LaunchError: --launcher slurm: sinfo lists no node in "
                                       "partition nosuch"), out["partition"]


#: The recipe's notebook (docs/recipes.md, "Slurm, with JupyterLab inside an allocation"): the
#: cells a person types in the JupyterLab that runs on the allocation's first node, and one that
#: prints what the test checks.
LAB_CELLS = [
    "%load_ext ipydist",
    "%dist_start --launcher slurm --timeout 120",
    "%%everyrank\n" + TRAIN + "\nimport socket\nhost = socket.gethostname()",
    """
import ipydist, json, os, subprocess
s = ipydist.magics_session()
out = {"hosts": s.pull("host"), "params": s.pull("params"), "losses": s.pull("losses", rank=0),
       "total": s.pull("total"), "job": os.environ.get("SLURM_JOB_ID"),
       "jobs": subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True,
                              text=True).stdout.split()}
print("RESULT " + json.dumps(out))
""",
    "%dist_stop",
]


def test_jupyterlab_inside_an_allocation_starts_ranks_with_launcher_slurm(slurm):
    """The recipe as written: ``salloc`` on the login host, JupyterLab started in it by
    ``srun`` on the first node (listening on the node's name), a kernel of that JupyterLab
    (driven over its REST API and websocket from the login host, as a page through a tunnel
    would) runs ``%dist_start --launcher slurm``: the ranks are one step of the same allocation,
    on both nodes, and train; ``%dist_stop`` ends them, and the allocation ends with JupyterLab."""
    root = slurm.dir / "lab"
    root.mkdir()
    write_server_config(root / "config", durable=False)
    token = uuid.uuid4().hex
    port = 8888
    lab = slurm.hosts.popen(slurm.login, [
        "salloc", "-N2", "-n4", "--time=5",
        "srun", "--nodes=1", "--ntasks=1", "bash", "-c",
        f"exec {sys.executable} -m jupyter lab --no-browser --allow-root --ip=$(hostname) "
        f"--port {port} --ServerApp.port_retries=0 --IdentityProvider.token={token} "
        f"--ServerApp.root_dir={root} --LabApp.check_for_updates_class="
        "jupyterlab.NeverCheckForUpdate"],
        cwd=root, env=slurm.env(JUPYTER_RUNTIME_DIR=str(root / "runtime"),
                                JUPYTER_CONFIG_DIR=str(root / "config"),
                                JUPYTER_DATA_DIR=str(root / "data")),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        done = slurm.hosts.run(slurm.login, [
            sys.executable, str(Path(__file__).parents[1] / "harness" / "lab_client.py"),
            f"http://node1:{port}", token, json.dumps(LAB_CELLS), "180"],
            capture_output=True, text=True, timeout=300, env=slurm.env())
        cells = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
        assert done.returncode == 0 and len(cells) == len(LAB_CELLS) and not any(
                c["error"] for c in cells), (
            f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        started = cells[1]["text"]
        assert "4 ranks on 2 hosts ready" in started, started
        out = json.loads(cells[3]["text"].split("RESULT ", 1)[1])
        assert f"with Slurm (srun in job {out['job']}) · " in started, started
        check_training(out | {"local": [0, 1, 0, 1]})
        # one allocation, JupyterLab's: the ranks are a step of it, not a job of their own
        assert out["jobs"] == [out["job"]], out
    finally:
        lab.send_signal(signal.SIGINT)
        try:
            lab.wait(20)
        except subprocess.TimeoutExpired:
            lab.kill()
            lab.wait(10)
        print(lab.stdout.read()[-3000:])
