"""The rows of the live cluster view, from what the notebook already knows: each rank's info
(host, pid), whether ipyparallel counts it alive and busy, the vitals the rank sent while its
cell ran (:mod:`ipydist.rank.vitals`), and the cell now running. Pure logic: the view
(:mod:`ipydist.notebook.live.cluster_view`) gathers the inputs and shows the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipydist.protocol import RankInfo

#: Vitals older than this are not the rank's present (it ended its cell, or stopped sending).
FRESH_SECONDS = 3.0
#: A replaced rank says so this long after its replacement was seen.
REPLACED_SECONDS = 60.0


@dataclass
class RunningCell:
    number: int | None
    ranks: list[int]


def state_of(rank: int, alive: str, vitals: dict | None, cell: RunningCell | None,
             replaced: bool) -> tuple[str, str]:
    """(kind, words): what ``rank`` does. ``alive`` is ``"idle"``, ``"busy"`` or ``"dead"``;
    ``vitals`` what it sent last, if fresh. The kind (idle, running, waiting, debugger, busy,
    dead) colours the row."""
    if alive == "dead":
        return "dead", "dead"
    running = cell is not None and rank in cell.ranks
    if running and vitals:
        if vitals.get("debugger"):
            return "debugger", "stopped at a breakpoint"
        if vitals.get("collective"):
            waited = vitals.get("waited", 0)
            return "waiting", f"waiting in {vitals['collective']} for {waited:.0f} s"
    if running:
        assert cell is not None  # running
        number = f"cell {cell.number}" if cell.number is not None else "a cell"
        return "running", f"running {number}"
    if alive == "busy":
        return "busy", "busy"
    return "idle", "idle, replaced" if replaced else "idle"


def megabytes(size: int | None) -> str:
    """A rank's memory as the live view and ``%dist_status`` both show it."""
    return "" if size is None else f"{size / 2**20:,.0f} MiB"


def gpu_text(gpu: dict | None) -> str:
    if not gpu:
        return ""
    return f"{gpu['util']} % · {gpu['used'] / 2**30:.1f}/{gpu['total'] / 2**30:.0f} GiB"


def step_text(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def row(info: RankInfo, alive: str, vitals: dict | None, usage: dict | None,
        cell: RunningCell | None, replaced: bool) -> dict:
    """One rank's row: ``vitals`` (fresh, else None) and ``usage`` (the notebook's own reading
    of a rank on this host: cpu, rss) fill its numbers; vitals win, being the rank's own."""
    numbers = {**(usage or {}), **{k: v for k, v in (vitals or {}).items() if v is not None}}
    kind, state = state_of(info.rank, alive, vitals, cell, replaced)
    return {
        "rank": info.rank, "host": info.host, "pid": info.pid,
        "state": state, "kind": kind,
        "cpu": "" if alive == "dead" or numbers.get("cpu") is None else f"{numbers['cpu']:.0f} %",
        "memory": "" if alive == "dead" else megabytes(numbers.get("rss")),
        "gpu": "" if alive == "dead" else gpu_text(numbers.get("gpu")),
        "step": step_text(numbers.get("step")),
    }
