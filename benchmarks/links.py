"""Across shaped links: allreduce and training steps on 2 hosts x 2 ranks joined by a network of
a given rate, ipydist against raw MPI, raw gloo and DDP, in the same run.

As root this builds the namespace test cluster (tests/harness/netns_hosts.py: a login host and
two nodes with their own sshd) once per link setting, with every host's eth0 shaped by ``tc``
(tests/harness/shaped_links.py: netem's rate and delay where the kernel has netem, else tbf's
rate alone, said in the output), and runs the measurement on the login host, as the tests do.
Ranks of one host talk through shared memory (MPI) or loopback (gloo), unshaped, as they would.

At each setting, the variants interleaved round by round in rotating order, medians reported:

- allreduce of float32 per size: ``ipydist`` (``hvd.allreduce_``, hierarchical across hosts
  where it is chosen), ``flat`` (the same call, the hierarchy switched off: ``--transport mpi``),
  ``mpi`` (mpi4py's ``Allreduce`` on COMM_WORLD) and ``gloo`` (``torch.distributed``); with the
  bus bandwidth (NCCL's: 2 (N-1)/N x bytes / time, N ranks) as a fraction of the link's rate;
- training step time of the 1.6 M-parameter MLP of benchmarks/compression.py: ``fp32``,
  ``fp16``, ``1-bit``, ``powersgd`` (rank 4), ``bmuf`` (ipydist's) and ``ddp`` (torch's
  DistributedDataParallel over gloo).

Printed: a table per setting, the bars of issue 36 and, with ``--plot``, a PNG of step time
against link rate.

    python benchmarks/links.py [--settings 1gbit 1gbit/node 10gbit] [--rounds 5]
    python benchmarks/links.py --plot docs/links.png [--plot-rates 200mbit 3gbit]
    python benchmarks/links.py --hosts node1:2,node2:2 --mpi-args "..."   # on a login host
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import allreduce  # noqa: E402 - the benchmarks beside this one: their rank code
import compression  # noqa: E402

SIZES = [64 << 10, 1 << 20, 8 << 20, 64 << 20]
REDUCE_VARIANTS = ["ipydist", "flat", "hier", "mpi", "gloo"]
STEP_VARIANTS = ["fp32", "fp16", "1-bit", "powersgd", "bmuf", "bmuf-16", "ddp", "local"]
STEPS = 16  # whole blocks of bmuf's (8 steps) and bmuf-16's
RESULT = "LINKS-RESULT "

RANK_CODE = allreduce.RANK_CODE + compression.RANK_CODE.replace(
    "BLOCK", str(compression.BLOCK)) + '''
from ipydist.torch._core import topology as _topology

def time_reduce(variant, nbytes):
    if variant not in ("flat", "hier"):
        return time_allreduce(variant, nbytes)
    rt = _topology.get()
    saved = rt.node_data, rt.cross_data
    if variant == "flat":  # every rank alike: the flat allreduce
        rt.node_data = rt.cross_data = None
    elif rt.node_data is None:  # the hierarchical one, where auto did not take it
        rt.node_data, rt.cross_data = rt.node_comm.Dup(), rt.cross_comm.Dup()
    try:
        return time_allreduce("ipydist", nbytes)
    finally:
        if rt.node_data is not None and rt.node_data is not saved[0]:
            rt.node_data.Free()
            rt.cross_data.Free()
        rt.node_data, rt.cross_data = saved

_wrap = wrap

def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)

def wrap(variant, model):  # compression.py's, and the variants only this benchmark times
    if variant == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        return model, sgd(model.parameters())
    if variant == "local":
        return model, sgd(model.parameters())
    if variant == "bmuf-16":
        return model, hvd.BlockMomentum(sgd(model.parameters()), block_steps=16)
    return _wrap(variant, model)

def time_step(variant, steps):
    return time_variant(variant, steps)[0]
'''


def rotated(variants: list[str], r: int) -> list[str]:
    return variants[r % len(variants):] + variants[:r % len(variants)]


def measure(hosts: str, mpi_args: str, rounds: int, sizes: list[int]) -> dict:
    """On the login host: every variant's median, in seconds (allreduce at ``sizes``)."""
    import ipydist

    reduce: dict = {}
    steps: dict = {v: [] for v in STEP_VARIANTS}
    with contextlib.redirect_stdout(sys.stderr), ipydist.Session(  # shown if it fails
            hosts=hosts, mpi_args=mpi_args, gpus="none", timeout=300) as s:
        s.run(RANK_CODE)
        transport = s.pull("_topology.get().node_data is not None", rank=0)
        for r in range(rounds):
            for size in sizes:
                for variant in rotated(REDUCE_VARIANTS, r):
                    s.run(f"sec = time_reduce({variant!r}, {size})")
                    reduce.setdefault(f"{size} {variant}", []).append(s.pull("sec", rank=0))
            for variant in rotated(STEP_VARIANTS, r):
                s.run(f"sec = time_step({variant!r}, {STEPS})")
                steps[variant].append(s.pull("sec", rank=0))
        n = s.size
    return {"ranks": n, "hierarchical": transport,
            "reduce": {k: statistics.median(v) for k, v in reduce.items()},
            "steps": {k: statistics.median(v) for k, v in steps.items()}}


def on_namespace_hosts(setting: str, rounds: int, steps_only: bool = False) -> dict:
    """Build 2 shaped namespace hosts and a login host; measure there. ``setting``: a rate
    (``1gbit``), and ``/node`` where the ranks are dealt out by node (rank 0 on node1, 1 on
    node2, ...), not by slot (0 and 1 on node1)."""
    rate, _, placement = setting.partition("/")
    sys.path.insert(0, str(HERE.parent / "tests" / "harness"))
    from netns_hosts import HostCluster, unavailable
    from shaped_links import Link

    if reason := unavailable():
        raise SystemExit(f"namespace hosts: {reason}")
    link = None if rate == "none" else Link(rate)
    with HostCluster(2, login=True, link=link) as cluster:
        hosts = ",".join(f"{h.name}:2" for h in cluster.hosts)
        # the hosts share this machine's cores: 4 ranks where each host counts 2 cores of its
        # own, so MPI would not know to yield them while it waits (as it does oversubscribed)
        mpi_args = shlex.join(["--prtemca", "plm_ssh_agent", cluster.rsh_agent,
                               "--mca", "mpi_yield_when_idle", "1",
                               *(["--map-by", "node"] if placement == "node" else [])])
        done = cluster.run("login", [sys.executable, __file__, "--hosts", hosts,
                                     f"--mpi-args={mpi_args}", "--rounds", str(rounds),
                                     *(["--steps-only"] if steps_only else [])],
                           capture_output=True, timeout=3600)
        out = done.stdout.decode(errors="replace")
        if done.returncode or RESULT not in out:
            raise SystemExit(f"{setting}: the measurement failed:\n{out[-2000:]}"
                             f"{done.stderr.decode(errors='replace')[-3000:]}")
        left = cluster.wait_no_processes(10)
        if left:
            raise SystemExit(f"left running on the hosts: {left}")
        result = json.loads(out.split(RESULT, 1)[1].splitlines()[0])
        result["shaped_with"] = cluster.shaped_with or "unshaped veth"
        result["bits_per_second"] = link.bits_per_second if link else None
    return result


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def report(setting: str, res: dict) -> dict:
    """Print one setting's tables; return its bar figures."""
    n, bps = res["ranks"], res["bits_per_second"]
    by = "by node" if setting.endswith("/node") else "by slot"
    print(f"\n{setting} ({res['shaped_with']}), 2 hosts x 2 ranks {by}, ipydist's allreduce "
          f"{'hierarchical' if res['hierarchical'] else 'flat'}; medians")
    if res["reduce"]:
        print("allreduce: ms per call (slowest rank); bus bandwidth as a fraction of the link")
        print(f"{'size':>7}" + "".join(f"{v:>9}" for v in REDUCE_VARIANTS)
              + f"{'flat/hier':>10}{'best raw/ipydist':>17}"
              + "".join(f"{'bw ' + v:>11}" for v in REDUCE_VARIANTS))
    figures = {}
    for size in SIZES if res["reduce"] else []:
        ms = {v: res["reduce"][f"{size} {v}"] * 1e3 for v in REDUCE_VARIANTS}
        bus = {v: 2 * (n - 1) / n * size * 8 / (ms[v] / 1e3) for v in REDUCE_VARIANTS}
        frac = {v: bus[v] / bps if bps else float("nan") for v in REDUCE_VARIANTS}
        best = min(ms["mpi"], ms["gloo"])
        print(f"{label(size):>7}" + "".join(f"{ms[v]:>9.2f}" for v in REDUCE_VARIANTS)
              + f"{ms['flat'] / ms['hier']:>9.2f}x{best / ms['ipydist']:>16.2f}x"
              + "".join(f"{frac[v]:>11.2f}" for v in REDUCE_VARIANTS))
        figures[size] = (ms, frac)
    steps = {v: res["steps"][v] * 1e3 for v in STEP_VARIANTS}
    print(f"\ntraining step ({STEPS} steps a round)\n{'variant':<9}{'ms/step':>10}{'x fp32':>9}"
          f"{'x ddp':>8}")
    for v in STEP_VARIANTS:
        print(f"{v:<9}{steps[v]:>10.2f}{steps[v] / steps['fp32']:>8.2f}x"
              f"{steps[v] / steps['ddp']:>7.2f}x")
    return {"reduce": figures, "steps": steps}


def bars(setting: str, fig: dict) -> list[tuple[str, bool]]:
    """Issue 36's bars that this setting measures."""
    steps, found = fig["steps"], []
    if fig["reduce"] and setting.startswith("10gbit"):
        ms = fig["reduce"][64 << 20][0]
        found += [(f"{setting}: ipydist >= 1.3x raw MPI (flat) at 64 MB",
                   ms["mpi"] >= 1.3 * ms["ipydist"]),
                  (f"{setting}: hierarchical >= 1.3x ipydist's flat path at 64 MB",
                   ms["flat"] >= 1.3 * ms["hier"])]
    if setting == "1gbit":
        found += [("1gbit: 1-bit step <= 0.5x fp32's", steps["1-bit"] <= 0.5 * steps["fp32"]),
                  ("1gbit: powersgd step < fp32's", steps["powersgd"] < steps["fp32"]),
                  ("1gbit: bmuf step <= 0.3x fp32's", steps["bmuf"] <= 0.3 * steps["fp32"]),
                  ("1gbit: bmuf-16 step <= 0.3x fp32's",
                   steps["bmuf-16"] <= 0.3 * steps["fp32"]),
                  ("1gbit: fp32 step <= 0.8x ddp's", steps["fp32"] <= 0.8 * steps["ddp"])]
        if fig["reduce"]:
            found.append(("1gbit: 64 MB allreduce >= 80 % of the link",
                          fig["reduce"][64 << 20][1]["ipydist"] >= 0.8))
    return found


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = sorted((r for s, r in results.items() if r["bits_per_second"] and "/" not in s),
                    key=lambda r: r["bits_per_second"])
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for v in STEP_VARIANTS:
        ax.plot([r["bits_per_second"] / 1e9 for r in shaped],
                [r["steps"][v] * 1e3 for r in shaped], marker="o", label=v)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    for axis, ticks in ((ax.xaxis, [0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]),
                        (ax.yaxis, [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000])):
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("link rate, Gbit/s (each host's)")
    ax.set_ylabel("ms per training step (median)")
    ax.set_title("1.6 M-parameter MLP, 2 hosts x 2 ranks (CPU)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    path.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nplot: {path}, its figures: {path.with_suffix('.json')} (--replot redraws it)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+",
                        default=["1gbit", "1gbit/node", "10gbit", "10gbit/node"],
                        help="link settings: tc's rates (none: unshaped), /node for ranks "
                        "dealt out by node")
    parser.add_argument("--plot-rates", nargs="*", default=["200mbit", "3gbit"],
                        help="more rates, by slot, for the plot: training steps only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    parser.add_argument("--hosts", help="measure on these hosts (on a login host; internal)")
    parser.add_argument("--mpi-args", default="")
    parser.add_argument("--replot", type=Path, default=None,
                        help="draw --plot again from the figures a run saved (its .json)")
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0
    if args.hosts:
        sizes = [] if args.steps_only else SIZES
        print(RESULT + json.dumps(measure(args.hosts, args.mpi_args, args.rounds, sizes)))
        return 0
    results, verdicts, failed = {}, [], []
    plot_only = [r for r in args.plot_rates if r not in args.settings] if args.plot else []
    for setting in args.settings + plot_only:  # each reported as it comes
        try:
            results[setting] = on_namespace_hosts(setting, args.rounds, setting in plot_only)
        except SystemExit as e:
            print(f"\n{e}", file=sys.stderr)
            failed.append(setting)
            continue
        verdicts += bars(setting, report(setting, results[setting]))
        sys.stdout.flush()
    if verdicts:
        print("\nbars:")
        for name, met in verdicts:
            print(f"  {name}: {'met' if met else 'not met'}")
    if args.plot and results:
        plot(results, args.plot)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 0 if all(met for _, met in verdicts) and not failed else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.TimeoutExpired:
        sys.exit("timed out")
