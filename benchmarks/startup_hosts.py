"""Start-up across hosts: ``Session(hosts=...)`` against the same number of ranks on this one
host, in the same run (``benchmarks/startup.py --hosts`` comes here).

Each start is timed until the first cell has run an allreduce on every rank, so the process
group is ready; the two kinds alternate (ABAB), and medians are reported with their ratio.
What crossing hosts adds: ssh to each host, PRRTE's daemons there, the TCP rendezvous.

    python benchmarks/startup_hosts.py --hosts nodeA:2,nodeB:2 [--mpi-args "..."] [--repeats 3]
    python benchmarks/startup_hosts.py --netns   # as root: 2 namespace hosts on this machine

``--netns`` builds the test cluster of tests/netns_hosts.py (a login host and two nodes with
their own sshd) and runs the measurement on its login host, as the tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

CELL = ("import torch, ipydist.torch as hvd\n"
        "total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()")


def time_start(**kwargs) -> float:
    """Seconds from start() until a cell has run an allreduce on every rank."""
    from ipydist import Session

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), Session(**kwargs, timeout=300) as s:
        s.run(CELL, output="rank0")
        total = s.pull("total", rank=0)
        seconds = time.perf_counter() - t0
        if total != s.size:
            raise RuntimeError(f"allreduce gave {total}, not {s.size}")
    return seconds


def measure(hosts: str, mpi_args: str, repeats: int) -> int:
    from ipydist.specs import parse_hosts

    n = sum(slots for _, slots in parse_hosts(hosts))
    across, here = [], []
    for _ in range(repeats):
        across.append(time_start(hosts=hosts, mpi_args=mpi_args))
        here.append(time_start(np=n))
    a, b = statistics.median(across), statistics.median(here)
    print(f"start until an allreduce cell has run, median of {repeats} (ABAB):")
    print(f"  {n} ranks on {hosts}: {a:6.2f} s   ({', '.join(f'{x:.2f}' for x in across)})")
    print(f"  {n} ranks on this host: {b:6.2f} s   ({', '.join(f'{x:.2f}' for x in here)})")
    print(f"  across hosts / one host: {a / b:.2f}x")
    return 0


def on_namespace_hosts(repeats: int) -> int:
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "tests"))
    from netns_hosts import HostCluster, unavailable

    if reason := unavailable():
        print(f"--netns: {reason}", file=sys.stderr)
        return 2
    with HostCluster(2, login=True) as cluster:
        hosts = ",".join(f"{h.name}:2" for h in cluster.hosts)
        mpi_args = shlex.join(["--prtemca", "plm_ssh_agent", cluster.rsh_agent])
        done = cluster.run("login", [sys.executable, __file__, "--hosts", hosts,
                                     f"--mpi-args={mpi_args}", "--repeats", str(repeats)],
                           capture_output=True, timeout=1800)
        print(done.stdout.decode(errors="replace"), end="")
        if done.returncode:
            print(done.stderr.decode(errors="replace")[-3000:], file=sys.stderr)
        left = cluster.wait_no_processes(10)
        if left:
            print(f"left running on the hosts: {left}", file=sys.stderr)
            return 1
        return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", help="hosts with slots, as %%dist_start --hosts takes them")
    parser.add_argument("--mpi-args", default="", help="extra mpiexec arguments")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--netns", action="store_true",
                        help="build 2 namespace hosts on this machine (root) and measure there")
    args = parser.parse_args(argv)
    if args.netns:
        return on_namespace_hosts(args.repeats)
    if not args.hosts:
        parser.error("give --hosts SPEC, or --netns")
    return measure(args.hosts, args.mpi_args, args.repeats)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired:
        sys.exit("timed out")
