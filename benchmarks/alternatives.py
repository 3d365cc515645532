"""One small training job, run from a notebook each way a user can, in the same run.

The ways, each driven from a fresh kernel as a user meets it (an IPython shell in a new Python
process, its cells run one by one through ``run_cell``):

(1) ipydist: ``%load_ext ipydist``, ``%dist_start --np N``, an ``%%everyrank`` cell that trains
    with ``hvd.DistributedOptimizer``, the accuracy pulled with ``%dist_pull``.
(2) plain ipyparallel: ``ipyparallel.Cluster(engines="mpi", n=N).start_and_connect_sync()``, the
    engines' ranks scattered, a ``%%px`` cell that makes torch.distributed's process group
    (gloo, ``env://``), a ``%%px`` cell that trains with DDP.
(3) torchrun: the kernel runs ``python -m torch.distributed.run --nproc_per_node N script``
    on a script that trains with DDP (gloo) and writes rank 0's accuracy to a file.
(4) Lightning ``ddp_notebook``: a LightningModule of the same MLP fitted by
    ``Trainer(accelerator="cpu", devices=N, strategy="ddp_notebook")``, which forks the kernel.
(5) Accelerate ``notebook_launcher(train_fn, num_processes=N)``, which forks the kernel too;
    ``train_fn`` prepares the model with ``Accelerator(cpu=True)`` (DDP over gloo).

The job is the same source text everywhere: scikit-learn's digits (no download), shuffled once
with a fixed seed, a 64-128-10 MLP, each rank on its own half of the training set (Lightning's
DistributedSampler picks the halves there), SGD with lr 0.1, gradients averaged over the ranks,
``--steps`` steps of 32 samples per rank; then the test accuracy on the 360 held-out digits.

What is timed, in the kernel, per cell: the first result, from the first cell (the kernel's
imports: ``%load_ext ipydist``, ``import ipyparallel``, ``import torch, lightning``...) until
the trained model's accuracy is known in the kernel; and the next run, a fresh model trained
by the same job in the next cell of the same kernel, which is where long-lived ranks pay off
(ipydist's and ipyparallel's ranks are still there; Lightning and Accelerate fork again;
torchrun starts again, so its next run is not measured: it costs what its first did). The next
cell also evaluates the first model again wherever it still is, to show what a next cell has.

Why: the comparison page of the docs quotes these figures; they should come from one run on one
machine, with every way doing the same work (the accuracies are printed to show that it did).

How: each way runs ``--repeats`` times, each time in a new kernel process, so every start is
cold as processes go: no fork server kept by an earlier ipydist cluster, torch imported again
by every rank (or by the kernel that forks them). A first pass over the ways (``--warmups``) is
left out: it reads the libraries from disk into the page cache, so that no way pays for that
alone. The order of the ways rotates and reverses from one repeat to the next, so that drift in
machine load hits all alike; medians are reported, with ratios against ipydist. Every process gets
``OMP_NUM_THREADS=1`` (one torch thread per rank; the threads column shows rank 0's). Each
kernel runs in its own session with a marker in its environment; whatever carries the marker
when its kernel is done is reported and killed, so nothing is left running, on error too.

    python benchmarks/alternatives.py [--np 2] [--steps 200] [--repeats 3] [--warmups 1]
    python benchmarks/alternatives.py --ways ipydist lightning   # some of the ways only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BATCH = 32
LR = 0.1
WAYS = ("ipydist", "ipyparallel", "torchrun", "lightning", "accelerate")
NOT_MEASURED = ("ray", "nbdistributed")  # Ray Train, nbdistributed: not installed here
MARKER_ENV = "ALTERNATIVES_BENCH_KERNEL"  # every process a measured kernel starts carries it
VALUES = ("first_accuracy", "next_accuracy", "kept_accuracy", "threads")

# The job, as the same source text on every rank of every way (STEPS, BATCH, LR, NP come first).
JOB = '''
import torch
from sklearn.datasets import load_digits


def digits_split():
    """Digits as tensors, pixels scaled to [0, 1], in one seeded shuffle (the same on every
    rank): 80 % to train, the rest to test."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = len(x) * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:]


def digits_mlp():
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def batch_indices(n, seed):
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n - BATCH + 1, BATCH):
            yield order[start:start + BATCH]


def train(model, opt, x, y, seed, backward=torch.Tensor.backward):
    for _, rows in zip(range(STEPS), batch_indices(len(x), seed)):
        opt.zero_grad()
        backward(torch.nn.functional.cross_entropy(model(x[rows]), y[rows]))
        opt.step()


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()
'''
DATA = "x_train, y_train, x_test, y_test = digits_split()\n"
HVD_TRAIN = '''
model = digits_mlp()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
train(model, opt, x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()],
      seed=hvd.rank())
acc, threads = accuracy(model, x_test, y_test), torch.get_num_threads()
'''
DDP_TRAIN = '''
from torch.nn.parallel import DistributedDataParallel as DDP

model = DDP(digits_mlp())
opt = torch.optim.SGD(model.parameters(), lr=LR)
train(model, opt, x_train[rank::world], y_train[rank::world], seed=rank)
acc, threads = accuracy(model.module, x_test, y_test), torch.get_num_threads()
'''
PROCESS_GROUP = '''
import os
import torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
dist.init_process_group("gloo", rank=rank, world_size=world)
'''
TORCHRUN_SCRIPT = '''
import json
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
{data}{train}
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({{"acc": acc, "threads": threads}}, f)
dist.destroy_process_group()
'''
TORCHRUN = '''
result = workdir + "/first.json"
completed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                            "{np}", "--master_port", str(free_port()), script, result])
assert completed.returncode == 0, f"torchrun exited with {{completed.returncode}}"
'''
LIGHTNING_MODULE = '''
import lightning.pytorch as pl


class DigitsModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = digits_mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def notebook_trainer():
    return pl.Trainer(accelerator="cpu", devices=NP, strategy="ddp_notebook", max_steps=STEPS,
                      max_epochs=-1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
'''
LIGHTNING_DATA = DATA + '''
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train),
                                     batch_size=BATCH, shuffle=True)
'''
ACCELERATE_TRAIN_FN = DATA + '''

def train_fn(result_path):
    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    model = digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = accelerator.prepare(model, opt)
    train(model, opt, x_train[rank::world], y_train[rank::world], seed=rank,
          backward=accelerator.backward)
    if accelerator.is_main_process:
        acc = accuracy(accelerator.unwrap_model(model), x_test, y_test)
        with open(result_path, "w") as f:
            json.dump({"acc": acc, "threads": torch.get_num_threads()}, f)
    accelerator.end_training()
'''
ACCELERATE_LAUNCH = '''
result = workdir + "/{name}.json"
notebook_launcher(train_fn, args=(result,), num_processes=NP, use_port=str(free_port()))
with open(result) as f:
    out = json.load(f)
{name}, threads = out["acc"], out["threads"]
'''
KERNEL_TOOLS = '''
import json
import shutil
import socket
import subprocess
import sys
import tempfile

workdir = tempfile.mkdtemp(prefix="alternatives-")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
'''


@dataclass(frozen=True)
class Cell:
    """One notebook cell of a way: ``phase`` says what its time counts toward: setup (not
    timed: what a user has typed before), imports and launch (the first result), next (the next
    run), teardown (not timed)."""

    phase: str
    label: str
    source: str


@dataclass(frozen=True)
class Way:
    cells: list[Cell]
    model_after: str  # where the trained model is for a next cell
    next_measured: bool = True


def job_source(np: int, steps: int) -> str:
    return f"STEPS, BATCH, LR, NP = {steps}, {BATCH}, {LR}, {np}\n" + JOB


def ipydist_way(np: int, steps: int) -> Way:
    first = "%%everyrank\n" + job_source(np, steps) + "import ipydist.torch as hvd\n\nhvd.init()\n"
    again = "%%everyrank\nkept_acc = accuracy(model, x_test, y_test)\n"
    return Way([
        Cell("imports", "load_ext", "%load_ext ipydist"),
        Cell("launch", "dist_start", f"%dist_start --np {np}"),
        Cell("launch", "train", first + DATA + HVD_TRAIN),
        Cell("launch", "pull", "first_accuracy = %dist_pull acc --rank 0\n"
                               "threads = %dist_pull threads --rank 0"),
        Cell("next", "train", again + HVD_TRAIN),
        Cell("next", "pull", "next_accuracy = %dist_pull acc --rank 0\n"
                             "kept_accuracy = %dist_pull kept_acc --rank 0"),
        Cell("teardown", "dist_stop", "%dist_stop"),
    ], "on the ranks")


def ipyparallel_way(np: int, steps: int) -> Way:
    oversubscribe = np > (os.cpu_count() or 1)  # OpenMPI will not start more otherwise
    start = (f'cluster = ipp.Cluster(engines="mpi", n={np})\n'
             + ('cluster.config.MPILauncher.mpi_args = ["--oversubscribe"]\n'
                if oversubscribe else "")
             + "rc = cluster.start_and_connect_sync()\n"
             "view = rc[:]\nview.block = True\nview.activate()\n"
             f'view.scatter("rank", list(range({np})), flatten=True)\n'
             f'view.push({{"world": {np}, "master_port": free_port()}})\n')
    return Way([
        Cell("setup", "tools", KERNEL_TOOLS),
        Cell("imports", "import", "import ipyparallel as ipp"),
        Cell("launch", "cluster", start),
        Cell("launch", "process group", "%%px\n" + PROCESS_GROUP),
        Cell("launch", "train", "%%px\n" + job_source(np, steps) + DATA + DDP_TRAIN),
        Cell("launch", "pull", 'first_accuracy, threads = view.pull("acc")[0], '
                               'view.pull("threads")[0]'),
        Cell("next", "train", "%%px\nkept_acc = accuracy(model.module, x_test, y_test)\n"
                              + DDP_TRAIN),
        Cell("next", "pull", 'next_accuracy, kept_accuracy = view.pull("acc")[0], '
                             'view.pull("kept_acc")[0]'),
        Cell("teardown", "stop", 'if "rc" in globals():\n    rc.close()\n'
                                 'if "cluster" in globals():\n    cluster.stop_cluster_sync()'),
    ], "on the engines")


def torchrun_way(np: int, steps: int) -> Way:
    script = job_source(np, steps) + TORCHRUN_SCRIPT.format(data=DATA, train=DDP_TRAIN)
    write = f'script = workdir + "/train.py"\nwith open(script, "w") as f:\n    f.write({script!r})'
    return Way([
        Cell("setup", "tools", KERNEL_TOOLS),
        Cell("setup", "script", write),
        Cell("launch", "torchrun", TORCHRUN.format(np=np)),
        Cell("launch", "read", "with open(result) as f:\n"
                               "    first = json.load(f)\n"
                               'first_accuracy, threads = first["acc"], first["threads"]'),
        Cell("teardown", "remove", "shutil.rmtree(workdir)"),
    ], "none: the ranks have exited (the script must save it)", next_measured=False)


def lightning_way(np: int, steps: int) -> Way:
    return Way([
        Cell("imports", "import", job_source(np, steps) + LIGHTNING_MODULE),
        Cell("launch", "data", LIGHTNING_DATA),
        Cell("launch", "fit", "module = DigitsModule()\ntrainer = notebook_trainer()\n"
                              "trainer.fit(module, loader)"),
        Cell("launch", "evaluate", "first_accuracy = accuracy(module.model, x_test, y_test)\n"
                                   "threads = torch.get_num_threads()"),
        Cell("next", "evaluate", "kept_accuracy = accuracy(module.model, x_test, y_test)"),
        Cell("next", "fit", "module2 = DigitsModule()\ntrainer2 = notebook_trainer()\n"
                            "trainer2.fit(module2, loader)\n"
                            "next_accuracy = accuracy(module2.model, x_test, y_test)"),
    ], "weights copied back to the kernel; the ranks have exited")


def accelerate_way(np: int, steps: int) -> Way:
    return Way([
        Cell("setup", "tools", KERNEL_TOOLS),
        Cell("imports", "import", job_source(np, steps)
             + "from accelerate import Accelerator, notebook_launcher\n"),
        Cell("launch", "data", ACCELERATE_TRAIN_FN),
        Cell("launch", "notebook_launcher", ACCELERATE_LAUNCH.format(name="first_accuracy")),
        Cell("next", "notebook_launcher", ACCELERATE_LAUNCH.format(name="next_accuracy")),
        Cell("teardown", "remove", "shutil.rmtree(workdir)"),
    ], "none: it lived in the forked ranks, which have exited")


WAY_PLANS = {"ipydist": ipydist_way, "ipyparallel": ipyparallel_way, "torchrun": torchrun_way,
             "lightning": lightning_way, "accelerate": accelerate_way}


# ---- in the kernel process ------------------------------------------------------------------

def cell_error(result) -> str | None:
    """What went wrong in a cell, on one line, or None if it ran."""
    if result.success:
        return None
    error = result.error_in_exec or result.error_before_exec
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' | '.join(lines[:3])[:300]}"


def run_way(ip, way: Way) -> dict:
    """Run a way's cells in order; a failure before the first result ends it, one in the next
    run is recorded; teardown always runs."""
    record: dict = {"cells": [], "failed": None, "next_error": None, "teardown_error": None}

    def run(cell: Cell) -> str | None:
        started = time.perf_counter()
        result = ip.run_cell(cell.source, store_history=True)
        record["cells"].append([cell.phase, cell.label, time.perf_counter() - started])
        return cell_error(result)

    try:
        for cell in way.cells:
            if cell.phase == "teardown" or (cell.phase == "next" and record["next_error"]):
                continue
            error = run(cell)
            if error and cell.phase == "next":
                record["next_error"] = f"{cell.label}: {error}"
            elif error:
                record["failed"] = f"{cell.label}: {error}"
                break
    finally:
        for cell in way.cells:
            if cell.phase == "teardown":
                error = run(cell)
                if error and not record["failed"]:
                    record["teardown_error"] = f"{cell.label}: {error}"
    return record


def plain(value):
    """A value from the kernel as JSON can carry it."""
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)[:80]


def kernel_main(name: str, np: int, steps: int, result_path: str) -> int:
    """Play a fresh notebook kernel running one way's cells; write what it saw to
    ``result_path``."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    record = run_way(ip, WAY_PLANS[name](np, steps))
    record["values"] = {key: plain(ip.user_ns.get(key)) for key in VALUES}
    Path(result_path).write_text(json.dumps(record))
    sys.stdout.flush()
    return 0


# ---- in the benchmark's process --------------------------------------------------------------

def prepare_environment() -> None:
    """Let OpenMPI run as root, find the venv's mpiexec first, one torch thread per process."""
    os.environ["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    os.environ["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])


def marked(matches) -> list:
    """The processes whose environment carries a marker that ``matches``."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if matches(process.environ().get(MARKER_ENV, "")):
                found.append(process)
        except psutil.Error:
            pass
    return found


def end_marked(matches, grace: float) -> list[str]:
    """Wait up to ``grace`` seconds for the marked processes to end by themselves, then end the
    rest; say which had to be ended."""
    import psutil

    _, alive = psutil.wait_procs(marked(matches), timeout=grace)
    notes = []
    for process in alive:
        try:
            notes.append(f"pid {process.pid} ({' '.join(process.cmdline())[:90]}) left running")
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=3)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    return notes


def run_kernel(name: str, args, marker: str) -> tuple[dict, list[str]]:
    """Run one way in a new kernel process; its record, and notes on what went wrong."""
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="alternatives-") as tmp:
        result_path, log_path = Path(tmp, "result.json"), Path(tmp, "kernel.log")
        command = [sys.executable, __file__, "--kernel", name, "--np", str(args.np),
                   "--steps", str(args.steps), "--result", str(result_path)]
        with open(log_path, "w") as log:
            kernel = subprocess.Popen(command, env={**os.environ, MARKER_ENV: marker},
                                      stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            grace = 10.0
            try:
                kernel.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                notes.append(f"{name}: kernel still running after {args.timeout} s, ended")
                grace = 0.0
            finally:
                left = end_marked(lambda value: value == marker, grace)
                kernel.wait()
        notes += [f"{name}: {note}" for note in left if grace]
        record = json.loads(result_path.read_text()) if result_path.exists() else {
            "failed": f"kernel exited with {kernel.returncode} and no result"}
        if record.get("failed") or record.get("teardown_error"):
            tail = log_path.read_text(errors="replace").splitlines()[-25:]
            record["log_tail"] = tail
    return record, notes


@dataclass
class Run:
    """What one kernel measured, in seconds."""

    imports: float
    launch: float
    next: float | None
    cells: list
    values: dict
    next_error: str | None

    @property
    def first(self) -> float:
        return self.imports + self.launch


def as_run(record: dict) -> Run:
    def phase(name: str) -> float:
        return sum(seconds for p, _, seconds in record["cells"] if p == name)

    has_next = any(p == "next" for p, _, _ in record["cells"]) and not record["next_error"]
    return Run(phase("imports"), phase("launch"), phase("next") if has_next else None,
               record["cells"], record["values"], record["next_error"])


def describe(name: str, label: str, run: Run) -> str:
    acc = run.values
    cells = ", ".join(f"{label} {seconds:.2f}" for phase, label, seconds in run.cells
                      if phase in ("imports", "launch", "next"))
    next_text = (f"{run.next:6.2f} s" if run.next is not None
                 else "failed" if run.next_error else "   n/a  ")
    return (f"{label} {name:<11} first {run.first:6.2f} s (imports {run.imports:5.2f}) "
            f"next {next_text}  acc {number(acc['first_accuracy'])}/"
            f"{number(acc['next_accuracy'])} kept {number(acc['kept_accuracy'])} "
            f"threads {acc['threads']}  [{cells}]")


def number(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(value: float, base: float) -> str:
    if value != value or base != base or not base:
        return "n/a"
    return f"{value / base:.2f}x"


def summary_row(name: str, runs: list[Run], way: Way, findings: list[str]) -> dict:
    """The medians of a way's runs, and what its next cell can use."""
    firsts = [r.first for r in runs]
    nexts = [r.next for r in runs if r.next is not None]
    kept = [r.values["kept_accuracy"] for r in runs
            if isinstance(r.values["kept_accuracy"], (int, float))]
    for error in sorted({r.next_error for r in runs if r.next_error}):
        findings.append(f"{name}: the next run failed: {error}")
    next_s = median(nexts)
    if not way.next_measured:
        next_s = median(firsts)  # a new start each time: it costs what the first did
    model_after = way.model_after + (f" ({median(kept):.3f} again)" if kept else "")
    return {
        "name": name, "first": median(firsts), "imports": median([r.imports for r in runs]),
        "launch": median([r.launch for r in runs]), "next": next_s,
        "next_measured": way.next_measured, "next_failed": bool(runs) and not nexts,
        "acc": (median([v for r in runs if isinstance(v := r.values["first_accuracy"], float)]),
                median([v for r in runs if isinstance(v := r.values["next_accuracy"], float)])),
        "model_after": model_after, "runs": len(runs),
    }


def print_table(rows: list[dict], repeats: int) -> None:
    base = next((row for row in rows if row["name"] == "ipydist"), None)
    base_first = base["first"] if base else float("nan")
    base_next = base["next"] if base else float("nan")
    print(f"\nMedians ({repeats} cold starts per way, failed runs left out; "
          f"load average now {os.getloadavg()[0]:.2f})")
    header = (f"{'way':<12}{'first s':>8}{'x ipydist':>10}{'imports s':>10}{'launch s':>9}"
              f"{'next s':>9}{'x ipydist':>10}{'test acc':>13}  model after the cell")
    print(header)
    print("-" * (len(header) + 40))
    for row in rows:
        if not row["runs"]:
            print(f"{row['name']:<12}{'failed (see notes)':>30}")
            continue
        mark = "" if row["next_measured"] else "*"
        next_text = "failed" if row["next_failed"] and row["next_measured"] else (
            f"{row['next']:.2f}{mark}")
        next_ratio = "n/a" if next_text == "failed" else ratio(row["next"], base_next) + mark
        acc = f"{number(row['acc'][0])}/{number(row['acc'][1]) if row['next_measured'] else '-'}"
        print(f"{row['name']:<12}{row['first']:>8.2f}{ratio(row['first'], base_first):>10}"
              f"{row['imports']:>10.2f}{row['launch']:>9.2f}{next_text:>9}{next_ratio:>10}"
              f"{acc:>13}  {row['model_after']}")
    print("""
first s: from a fresh kernel's first cell (its imports) until the trained model's test accuracy
  is known in the kernel: ranks started, process group made, data loaded, the steps trained.
imports s: the part of it spent importing in the kernel; launch s: the rest.
next s: a fresh model trained by the same job in the next cell of the same kernel (ranks kept by
  ipydist and ipyparallel; Lightning and Accelerate fork again). * torchrun: not measured, every
  run is a new start and costs what the first did; its first figure is repeated.
x ipydist: that column's median over ipydist's. test acc: median accuracy on the 360 held-out
  digits, first run/next run. model after the cell: where the trained model is for the next
  cell (evaluated again there, when it is somewhere).""")


def print_cell_medians(runs: dict[str, list[Run]]) -> None:
    """Each timed cell's median, per way: where the time goes (Lightning's fit call, say)."""
    print("\nCell medians, s (imports and launch make the first result; next, the next run):")
    for name, way_runs in runs.items():
        if not way_runs:
            continue
        labels = [(phase, label) for phase, label, _ in way_runs[0].cells
                  if phase in ("imports", "launch", "next")]
        parts = []
        for phase, label in labels:
            seconds = [s for r in way_runs for p, lab, s in r.cells if (p, lab) == (phase, label)]
            parts.append(f"{phase}:{label} {median(seconds):.2f}")
        print(f"  {name:<11} " + ", ".join(parts))


def versions() -> str:
    names = ("ipydist", "torch", "ipyparallel", "lightning", "accelerate", "scikit-learn")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} missing")
    return ", ".join(found)


def not_measured_line() -> str:
    state = ", ".join(
        f"{name}: {'installed' if importlib.util.find_spec(name) else 'not installed'}"
        for name in NOT_MEASURED)
    return (f"Ray Train and nbdistributed: not measured, they are not installed in this "
            f"environment and this benchmark does not install them ({state}).")


def order_of(repeat: int, ways: list[str]) -> list[str]:
    """The ways rotated by one per repeat, and reversed every other repeat."""
    shift = repeat % len(ways)
    order = ways[shift:] + ways[:shift]
    return order[::-1] if repeat % 2 else order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2, help="ranks of every way")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="cold starts per way")
    parser.add_argument("--warmups", type=int, default=1,
                        help="passes over the ways first, left out of the medians: they fill "
                        "the page cache, so that no way pays for reading the libraries from disk")
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS,
                        help="the ways to measure (default: all)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds a kernel may take before it is ended")
    parser.add_argument("--kernel", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kernel:
        return kernel_main(args.kernel, args.np, args.steps, args.result)

    prepare_environment()
    print(f"{versions()}, Python {platform.python_version()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"np={args.np}, {args.steps} steps of {BATCH} per rank, SGD lr {LR}; OMP_NUM_THREADS=1 "
          f"for every process. Every run is a cold start in a fresh kernel process (for ipydist:"
          f" no fork server kept from an earlier cluster); 'next' is the next cell in that "
          f"kernel. {args.warmups} warm-up pass(es) first, left out of the medians.")
    token = secrets.token_hex(6)
    notes: list[str] = []
    findings: list[str] = []
    runs: dict[str, list[Run]] = {name: [] for name in args.ways}
    passes = [("warm-up", list(args.ways))] * args.warmups + [
        (f"#{repeat + 1}", order_of(repeat, list(args.ways))) for repeat in range(args.repeats)]
    try:
        for index, (label, order) in enumerate(passes):
            for name in order:
                record, kernel_notes = run_kernel(name, args, f"{token}-{index}-{name}")
                notes += kernel_notes
                if record.get("failed"):
                    print(f"{label} {name:<11} FAILED: {record['failed']}", flush=True)
                    notes.append(f"{name} run {label} failed: {record['failed']}")
                    notes += [f"    {line}" for line in record.get("log_tail", [])]
                    continue
                if record.get("teardown_error"):
                    notes.append(f"{name} run {label}: {record['teardown_error']}")
                run = as_run(record)
                if label != "warm-up":
                    runs[name].append(run)
                print(describe(name, label, run), flush=True)
    finally:
        notes += end_marked(lambda value: value.startswith(f"{token}-"), 0.0)

    rows = [summary_row(name, runs[name], WAY_PLANS[name](args.np, args.steps), findings)
            for name in args.ways]
    print_cell_medians(runs)
    print_table(rows, args.repeats)
    print()
    print(not_measured_line())
    for finding in findings:
        print(f"finding: {finding}")
    for note in notes:
        print(f"note: {note}")
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
