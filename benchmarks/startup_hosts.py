"""Start-up across hosts: ``Session(hosts=...)`` against the same number of ranks on this one
host, in the same run (``benchmarks/startup.py --hosts`` comes here).

Each start is timed until the first cell has run an allreduce on every rank, so the process
group is ready; the two kinds alternate (ABAB), and medians are reported with their ratio.
What crossing hosts adds: ssh to each host, PRRTE's daemons there, the TCP rendezvous.
With ``--slurm``, a third kind alternates with them: the same number of ranks started by
``--launcher slurm`` (salloc for a new allocation, then srun), from a login node.

    python benchmarks/startup_hosts.py --hosts nodeA:2,nodeB:2 [--mpi-args "..."] [--repeats 3]
    python benchmarks/startup_hosts.py --hosts nodeA:2,nodeB:2 --slurm [--partition P]
    python benchmarks/startup_hosts.py --netns [--slurm]   # as root: 2 namespace hosts here

``--netns`` builds the test cluster of tests/harness/netns_hosts.py (a login host and two nodes with
their own sshd; with ``--slurm``, slurmctld and two slurmds on them: tests/harness/slurm_cluster.py)
and runs the measurement on its login host, as the tests do.
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


def measure(hosts: str, mpi_args: str, repeats: int, slurm: bool = False,
            partition: str | None = None) -> int:
    from ipydist.specs import parse_hosts

    n = sum(slots for _, slots in parse_hosts(hosts))
    across, here, by_slurm = [], [], []
    for _ in range(repeats):
        across.append(time_start(hosts=hosts, mpi_args=mpi_args))
        here.append(time_start(np=n))
        if slurm:
            by_slurm.append(time_start(np=n, launcher="slurm", partition=partition))
    a, b = statistics.median(across), statistics.median(here)
    kinds = "ABCABC" if slurm else "ABAB"
    print(f"start until an allreduce cell has run, median of {repeats} ({kinds}):")
    print(f"  {n} ranks on {hosts}: {a:6.2f} s   ({', '.join(f'{x:.2f}' for x in across)})")
    print(f"  {n} ranks on this host: {b:6.2f} s   ({', '.join(f'{x:.2f}' for x in here)})")
    if slurm:
        c = statistics.median(by_slurm)
        print(f"  {n} ranks by --launcher slurm (salloc, srun): {c:6.2f} s   "
              f"({', '.join(f'{x:.2f}' for x in by_slurm)})")
    print(f"  across hosts / one host: {a / b:.2f}x")
    if slurm:
        print(f"  Slurm / mpiexec across hosts: {c / a:.2f}x")
    return 0


def on_namespace_hosts(repeats: int, slurm: bool = False) -> int:
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "tests" / "harness"))
    from netns_hosts import HostCluster, unavailable

    if reason := unavailable():
        print(f"--netns: {reason}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        env = None
        if slurm:
            from slurm_cluster import SlurmCluster
            from slurm_cluster import unavailable as no_slurm

            if reason := no_slurm():
                print(f"--netns --slurm: {reason}", file=sys.stderr)
                return 2
            slurm_cluster = stack.enter_context(SlurmCluster(nodes=2))
            cluster, env = slurm_cluster.hosts, slurm_cluster.env()
        else:
            cluster = stack.enter_context(HostCluster(2, login=True))
        hosts = ",".join(f"{h.name}:2" for h in cluster.hosts)
        mpi_args = shlex.join(["--prtemca", "plm_ssh_agent", cluster.rsh_agent])
        done = cluster.run("login", [sys.executable, __file__, "--hosts", hosts,
                                     f"--mpi-args={mpi_args}", "--repeats", str(repeats),
                                     *(["--slurm"] if slurm else [])],
                           capture_output=True, timeout=1800, env=env)
        print(done.stdout.decode(errors="replace"), end="")
        if done.returncode:
            print(done.stderr.decode(errors="replace")[-3000:], file=sys.stderr)
        if slurm:  # the daemons stay until the cluster goes: jobs and their processes must not
            jobs, left = slurm_cluster.wait_quiet(10)
            left = {**left, **({"squeue": jobs} if jobs else {})}
        else:
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
    parser.add_argument("--slurm", action="store_true",
                        help="also time --launcher slurm (salloc, then srun) from this host")
    parser.add_argument("--partition", default=None, help="with --slurm: the partition")
    args = parser.parse_args(argv)
    if args.netns:
        return on_namespace_hosts(args.repeats, args.slurm)
    if not args.hosts:
        parser.error("give --hosts SPEC, or --netns")
    return measure(args.hosts, args.mpi_args, args.repeats, args.slurm, args.partition)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired:
        sys.exit("timed out")
