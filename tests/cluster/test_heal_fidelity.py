"""A heal holds for the notebooks people write: the replacement is the rank it replaces, and a
heal never half-succeeds (issue 68).

One notebook's worth of rank-side state, of 21 kinds (a module from a cell-added ``sys.path``
entry, one from a changed working directory, one whose file is gone, a class, a closure and a
dataclass instance from cells, a DDP model, a compiled model, an FSDP2 module on a 1-D mesh,
an optimizer with momentum, an LR scheduler, a GradScaler, a DataLoader with a worker and an
``hvd.shard`` sampler, a mid-epoch iterator, numpy's and torch's random states, an environment
variable, ``torch.set_num_threads`` and the matmul precision, ``%autoreload 2``, matplotlib's
backend, the shell itself, an open file), on a real ``--elastic`` cluster. Rank 1 is
SIGKILLed between cells, then in the middle of a training loop, then beside CPU hogs; the
cluster grows 2 -> 3; rank 0 is killed (the copy then comes from rank 1). After each, every
variable is there on every rank or named as not copied (and then says so when used, never a
``NameError``), the process state is rank 0's, and training goes on in step: the parameters
bit-identical on every rank. A variable that does not load on the replacement is left out by
name while the rest are copied; a heal that cannot copy at all removes its replacement
(``--min-np``), never leaving a rank without state taking cells.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from helpers import wait_gone

import ipydist

NP = 2

#: Every rank's state, made again before each kill. ``PROJ`` and ``WORK`` are set by the test.
STATE = """
import dataclasses, os, sys, time
import numpy as np, torch, ipydist.torch as hvd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
if PROJ not in sys.path:
    sys.path.insert(0, PROJ)
import mymodel                                   # a module from a cell-added sys.path entry
os.chdir(WORK)
import workmod                                   # a module from the working directory
import gonemod                                   # its file removed below: travels by value
os.environ["MY_SETTING"] = "on"
torch.set_num_threads(1)
torch.set_float32_matmul_precision("medium")
ip = get_ipython()
ip.run_line_magic("load_ext", "autoreload")
ip.run_line_magic("autoreload", "2")
import matplotlib
matplotlib.use("agg")
class Doubler:                                   # a class from a cell
    def __call__(self, x):
        return 2 * x
def make_adder(n):                               # a closure
    def add(x):
        return x + n
    return add
add3 = make_adder(3)
@dataclasses.dataclass
class Config:
    lr: float
    batch: int
config = Config(lr=0.05, batch=16)               # a dataclass instance
torch.manual_seed(0)
net = mymodel.Net()
ddp = DDP(net)                                   # a DDP model
opt = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
scaler = torch.amp.GradScaler("cpu")
compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
mesh = init_device_mesh("cpu", (hvd.size(),))
fsdp = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
X = torch.randn(256, 4, generator=torch.Generator().manual_seed(1))
Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
data = TensorDataset(X, Y)
sampler = hvd.shard(data, seed=2)
loader = DataLoader(data, batch_size=config.batch, sampler=sampler, num_workers=1)
it = iter(loader)
first = next(it)                                 # a mid-epoch iterator
np.random.seed(5)
log = open(os.path.join(WORK, f"log-{hvd.rank()}.txt"), "w")   # an open file
def train(steps, pause=0.0):
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            loss = ((ddp(Doubler()(x)) - y) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            done += 1
            time.sleep(pause)
            if done == steps:
                break
    return loss.item()
def same_everywhere():
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return bool(hvd.allreduce(flat, op=hvd.Max).equal(hvd.allreduce(flat, op=hvd.Min)))
hvd.barrier()
if hvd.rank() == 0:
    os.remove(os.path.join(PROJ, "gonemod.py"))
hvd.barrier()
train(2)
"""

#: The names STATE leaves; those a heal cannot copy, with what their use raises.
NAMES = ["ip", "matplotlib", "mymodel", "workmod", "gonemod", "Doubler", "make_adder", "add3",
         "Config", "config", "net", "ddp", "opt", "sched", "scaler", "compiled", "mesh", "fsdp",
         "data", "sampler", "loader", "it", "first", "log", "train", "same_everywhere"]
NOT_COPIED = {"it", "log", "fsdp", "mesh"}

#: What each rank says of itself after a heal.
CHECK = """
import ipydist as _ipydist
def _used(name, use):
    try:
        use()
    except _ipydist.IpydistError as e:
        return f"{type(e).__name__}: {name}" if name in str(e) else f"unnamed: {e}"
    except NameError as e:
        return f"NameError: {e}"
    return "worked"
report = {
    "missing": [n for n in NAMES if n not in globals()],
    "cwd": os.getcwd() == WORK, "path": PROJ in sys.path,
    "env": os.environ.get("MY_SETTING"), "threads": torch.get_num_threads(),
    "precision": torch.get_float32_matmul_precision(),
    "autoreload": ("IPython.extensions.autoreload" in get_ipython().extension_manager.loaded and
                   get_ipython().magics_manager.registry["AutoreloadMagics"]._reloader.check_all),
    "matplotlib": sys.modules["matplotlib"].get_backend(),
    "modules": [m for m in ("mymodel", "workmod") if m in sys.modules],
    "gone": gonemod.triple(2), "add3": add3(1), "config": (config.lr, config.batch),
    "doubler": Doubler()(2), "compiled": tuple(compiled(torch.ones(1, 4)).shape),
    "sampler": (sampler.rank, sampler.num_replicas) == (hvd.rank(), hvd.size()),
    "momentum": len(opt.state) > 0, "sched": sched.last_epoch > 0,
    "scale": scaler.get_scale() > 0,
    "fsdp": _used("fsdp", lambda: fsdp(torch.ones(2, 4))),
    "mesh": _used("mesh", lambda: mesh.get_group()),
}
report["loss"] = train(3)
report["in_step"] = same_everywhere()
"""


def _write(folder, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 2-rank --elastic cluster (a hot spare first, spawned replacements after) for the
    module, its user modules in folders of the test's own."""
    root = tmp_path_factory.mktemp("heal-fidelity")
    proj, work = root / "proj", root / "work"
    proj.mkdir()
    work.mkdir()
    _write(proj, "mymodel.py", "import torch\n\nclass Net(torch.nn.Module):\n"
           "    def __init__(self):\n        super().__init__()\n"
           "        self.fc = torch.nn.Linear(4, 1)\n\n"
           "    def forward(self, x):\n        return self.fc(x)\n")
    _write(work, "workmod.py", "SCALE = 2\n")
    session = ipydist.Session(np=NP, elastic=True, min_np=1).start()
    try:
        session.push(PROJ=str(proj), WORK=str(work), NAMES=NAMES)
        yield session, str(proj), str(work)
    finally:
        pids = session.cluster.pids() if session.cluster is not None else []
        session.stop(quiet=True)
        assert wait_gone(pids, 10) == []


def _state(session, proj: str) -> None:
    _write(proj, "gonemod.py", "def triple(x):\n    return 3 * x\n")
    session.run(STATE)


def _heal(session, rank: int) -> str:
    """SIGKILL ``rank`` between cells; the heal's line."""
    os.kill(session.ranks[rank]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while session.healing is None:
        assert time.monotonic() < deadline, "the death was not seen"
        session.start_heal()
        time.sleep(0.02)
    lines = session.healing.wait()
    session.healed()
    return " ".join(lines)


def _checked(session, new: list[int], line: str) -> None:
    """Every rank has every variable, or (the new ranks) a stand-in that names it when used;
    rank 0's process state; training in step."""
    assert "process state, variables and random states copied" in line, line
    assert "4 variables not copied" in line, line
    for name in NOT_COPIED:
        assert f"{name} (" in line, line
    session.run(CHECK)
    reports = session.pull("report")
    for rank, report in enumerate(reports):
        where = f"rank {rank}: {report}"
        assert report["missing"] == [], where
        assert report["cwd"] and report["path"], where
        assert report["env"] == "on" and report["threads"] == 1, where
        assert report["precision"] == "medium" and report["autoreload"], where
        assert report["matplotlib"] == "agg", where
        assert report["modules"] == ["mymodel", "workmod"], where
        assert (report["gone"], report["add3"], report["doubler"]) == (6, 4, 4), where
        assert report["config"] == (0.05, 16) and report["compiled"] == (1, 4), where
        assert report["sampler"] and report["momentum"] and report["sched"], where
        assert report["scale"], where
        assert report["in_step"], where
        kind = "NotCopiedError" if rank in new else "GroupGone"
        assert report["fsdp"] == f"{kind}: fsdp", where
        assert report["mesh"] == f"{kind}: mesh", where
    assert _use(session, new, "it", "next(it)") == ["NotCopiedError: it"] * len(new)


def _use(session, ranks: list[int], name: str, use: str) -> list[str]:
    """What using ``name`` as ``use`` does on ``ranks`` (``CHECK``'s ``_used``)."""
    session.run(f"used = _used({name!r}, lambda: {use})", ranks=ranks)
    return [session.pull("used", rank=r) for r in ranks]


def test_a_rank_killed_between_cells_is_replaced_whole(cluster):
    session, proj, _ = cluster
    _state(session, proj)
    line = _heal(session, 1)
    assert "DistributedDataParallel models moved onto the new group: ddp" in line, line
    assert "sent by value, as the new rank could not import them: gonemod" in line, line
    assert "made over the old group, to be made again before use: fsdp (fully_shard it " \
           "again), mesh (init_device_mesh again)" in line, line
    _checked(session, [1], line)


def test_a_rank_killed_in_the_middle_of_a_training_loop(cluster):
    session, proj, _ = cluster
    _state(session, proj)
    victim = session.ranks[1]["pid"]
    threading.Timer(1.0, os.kill, (victim, signal.SIGKILL)).start()
    with pytest.raises(ipydist.errors.RankDied):
        session.run("train(10_000, pause=0.01)")
    session.start_heal()
    lines = session.healing.wait()
    session.healed()
    _checked(session, [1], " ".join(lines))


def test_a_grown_rank_gets_the_same_and_then_rank_0_is_killed(cluster):
    """%dist_scale 2 -> 3: the new rank gets rank 0's process and variables; then rank 0
    dies, and the copy comes from the lowest survivor, rank 1."""
    session, proj, _ = cluster
    _state(session, proj)
    session.scale(3)
    try:
        session.run(CHECK)
        reports = session.pull("report")
        assert [r["missing"] for r in reports] == [[]] * 3, reports
        assert all(r["in_step"] and r["threads"] == 1 and r["cwd"] for r in reports), reports
        assert reports[2]["fsdp"] == "NotCopiedError: fsdp", reports[2]
        assert reports[2]["gone"] == 6 and reports[2]["sampler"], reports[2]
        assert reports[2]["autoreload"] and reports[2]["precision"] == "medium", reports[2]
        _state(session, proj)
        line = _heal(session, 0)
        assert "copied from rank 1" in line, line
        _checked(session, [0], line)
    finally:
        session.scale(NP)


#: Objects that do not load on any rank but rank 0 (their __setstate__ refuses).
RANK0_ONLY = """
class Rank0Only:
    def __init__(self, n):
        self.n = n
    def __setstate__(self, state):
        if hvd.rank() != 0:
            raise ValueError("this object loads on rank 0 only")
        self.__dict__.update(state)
"""


def test_beside_cpu_hogs_a_variable_that_does_not_load_is_left_out_by_name(cluster, hogs):
    """Under load, with one variable that loads on rank 0 only: it is named with why, the
    others copied; on the replacement its name says so when used."""
    session, proj, _ = cluster
    _state(session, proj)
    session.run(RANK0_ONLY + "odd = Rank0Only(1)\nkept = {'still': 'here'}")
    line = _heal(session, 1)
    assert "odd (ValueError: this object loads on rank 0 only)" in line, line
    _checked(session, [1], line.replace("5 variables not copied", "4 variables not copied"))
    assert session.pull("kept") == [{"still": "here"}] * NP
    assert _use(session, [1], "odd", "odd.n") == ["NotCopiedError: odd"]
    session.run("del odd")


def test_a_copy_that_fails_whole_removes_its_replacement(cluster):
    """Each try blames one more variable; past the tries the copy is given up, and with
    --min-np 1 the survivor goes on alone, renumbered, each with its state: no rank without
    state takes cells. A grow that cannot copy removes its new rank the same way; once the
    variables that do not load are gone, the cluster grows back."""
    session, proj, _ = cluster
    _state(session, proj)
    session.run(RANK0_ONLY + "odds = [Rank0Only(i) for i in range(3)]\n"
                + "".join(f"odd{i} = Rank0Only({i})\n" for i in range(9)))
    line = _heal(session, 1)
    assert "rank 1 could not be given rank 0's state" in line, line
    assert "its replacement was removed: the cluster goes on with 1 ranks" in line, line
    assert session.size == 1
    assert session.pull("config.batch") == [16]
    assert "refuses" not in session.status().note
    # a grow whose new rank cannot be given the state removes it too
    with pytest.raises(ipydist.errors.ClusterError, match=r"1 ranks -> 2: the new ranks could "
                       r"not be given rank 0's state \(.*\), so they were removed; the cluster "
                       r"goes on with its 1 ranks"):
        session.scale(NP)
    assert session.size == 1 and session.pull("config.batch") == [16]
    session.run("".join(f"del odd{i}\n" for i in range(9)) + "del odds")
    session.scale(NP)
    assert session.pull("config.batch") == [16] * NP
