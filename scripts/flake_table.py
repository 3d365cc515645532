"""Run test files again and again, quiet and beside CPU hogs, and print a table of failures.

    .venv/bin/python scripts/flake_table.py [--runs 5] [--hogs 2] FILE_OR_FOLDER...

Each file runs ``--runs`` times in a row with nothing beside it, then as many times beside
``--hogs`` busy loops (Python processes spinning at normal priority, as the tests' own ``hogs``
fixture makes): each run is a pytest of its own, so every run starts its clusters, hosts and
kernels afresh. The last column is the median CPU-seconds the whole machine was busy during a
quiet run (ranks, daemons and browsers included): where a cut of the suite's time pays. A
table in Markdown follows each file's runs (so a long hunt shows its results as it goes),
and the whole table at the end; a failed run's output is kept in ``flake-runs/``. Run nothing
else meanwhile: the hogs are the only load a run should meet.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed|error).*?) in [\d.]+s")


def files(paths: list[str]) -> list[Path]:
    """The test files under ``paths`` (a folder means its ``test_*.py`` files), sorted."""
    found = []
    for p in map(Path, paths):
        found += sorted(p.glob("test_*.py")) if p.is_dir() else [p]
    return found


def busy_seconds() -> float:
    """CPU-seconds the whole machine has been busy (every process's, daemons' included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def run_once(path: Path, log: Path) -> tuple[bool, str, float, float]:
    """(passed, pytest's summary, seconds, the machine's busy CPU-seconds) of one run."""
    started, busy = time.monotonic(), busy_seconds()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(path)], cwd=ROOT, capture_output=True, text=True)
    seconds, busy = time.monotonic() - started, busy_seconds() - busy
    out = proc.stdout + proc.stderr
    summary = next((m.group(1) for line in reversed(out.splitlines())
                    if (m := SUMMARY.match(line))), f"exit {proc.returncode}")
    if proc.returncode != 0:
        log.parent.mkdir(exist_ok=True)
        log.write_text(out[-60000:])
    return proc.returncode == 0, summary, seconds, busy


def beside_hogs(count: int):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def row(path: Path, results: dict[str, list]) -> str:
    cells = []
    for mode in ("quiet", "hogs"):
        runs = results[mode]
        failed = sum(not ok for ok, *_ in runs)
        median = sorted(s for _, _, s, _ in runs)[len(runs) // 2] if runs else 0.0
        cells.append(f"{failed}/{len(runs)} failed, median {median:.0f} s")
    quiet = sorted(b for *_, b in results["quiet"])
    cells.append(f"{quiet[len(quiet) // 2]:.0f}" if quiet else "")
    return f"| {path.relative_to(ROOT) if path.is_absolute() else path} | {' | '.join(cells)} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=2)
    args = ap.parse_args()
    header = (f"| file | quiet | beside {args.hogs} hogs | busy CPU-s, quiet |\n"
              "| --- | --- | --- | --- |")
    rows, failures = [], 0
    for path in files(args.paths):
        results: dict[str, list] = {"quiet": [], "hogs": []}
        for mode in ("quiet", "hogs"):
            hogs = beside_hogs(args.hogs) if mode == "hogs" else []
            try:
                for i in range(args.runs):
                    log = ROOT / "flake-runs" / f"{path.stem}.{mode}.{i}.log"
                    ok, summary, seconds, busy = run_once(path, log)
                    results[mode].append((ok, summary, seconds, busy))
                    failures += not ok
                    print(f"{path} {mode} {i + 1}: {summary} ({seconds:.0f} s, "
                          f"{busy:.0f} busy CPU-s)"
                          + ("" if ok else f" -> {log}"), flush=True)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
        rows.append(row(path, results))
        print(rows[-1], flush=True)
    print("\n" + header + "\n" + "\n".join(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
