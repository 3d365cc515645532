"""``%dist_status``'s table: one row per rank (host, pid, device, state, memory).

After a rank died, mpiexec ends the others, so "dead" on every row would hide what happened.
Instead the table says which rank died first and what ended it (the signal or exit code the
launcher reported), shows the others as stopped by the launcher, gives no memory for ranks
that have none, and a note under it says what to do next, in the words the cell's error used.
"""

from __future__ import annotations

import html

import psutil

from ipydist.errors import wrap_message
from ipydist.notebook.launch import deaths, processes
from ipydist.notebook.launch.deaths import Death
from ipydist.notebook.live.cluster_state import megabytes
from ipydist.notebook.output import display
from ipydist.protocol import RankInfo
from ipydist.specs import describe_ranks

COLUMNS = ["rank", "host", "pid", "device", "state", "memory"]
#: The memory cell of a rank that has no process to measure.
NO_MEMORY = "-"


class StatusTable(display.Table):
    """A :class:`~ipydist.notebook.output.display.Table` with a note under it."""

    def __init__(self, columns, rows, caption="", note: str = "") -> None:
        super().__init__(columns, rows, caption)
        self.note = note

    def __str__(self) -> str:
        text = super().__str__()
        return "\n".join([text, *(wrap_message(self.note) if self.note else [])])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return super()._repr_html_() + note


def cluster_status(cluster, restart: str, healing: str = "") -> StatusTable:
    """The table of ``cluster``'s ranks as they are now (``restart``: how the user starts a
    fresh cluster, for the note after a death). ``healing``: where a heal under way is, said
    under the table instead of what ended a dead rank (the heal replaces it)."""
    states, memory = {}, {}
    for info in cluster.ranks:
        states[info.rank], proc = cluster.rank_state(info.rank)
        size = processes.resident_bytes(proc)  # None: no process here, or it died meanwhile
        if size is not None:
            memory[info.rank] = megabytes(size)
    dead = [info for info in cluster.ranks if states[info.rank] == "dead"]
    death, report = None, ""
    if healing:
        return status_table(grouped_by_host(cluster.ranks), states, memory,
                            launcher=cluster.plan.command_name, healing=healing)
    if dead:
        output = cluster.launcher_output(wait_for_exit=2.0)
        death = deaths.find_death(output, cluster.first_dead or dead)
        report = deaths.describe_death(output, dead, restart, cluster.plan.command_name,
                                       first=cluster.first_dead)
    table = status_table(grouped_by_host(cluster.ranks), states, memory, death, report,
                         cluster.plan.command_name)
    table.note = table.note or spares_note(cluster.spare_pids)
    return table


def start_table(ranks: list[RankInfo], seconds: float, spare_pids=()) -> StatusTable:
    """The table after a start. Its caption is short: in HTML a caption is as wide as the
    table, so a longer one wraps (the columns already say the backend and the ranks); ranks
    that share GPUs get one line under it (:func:`sharing_note`), and hot spares one
    (:func:`spares_note`)."""
    rows = [[i.rank, i.host, i.pid, i.device, i.backend, i.transport]
            for i in grouped_by_host(ranks)]
    hosts = len({i.host for i in ranks})
    where = f" on {hosts} hosts" if hosts > 1 else ""
    caption = f"{len(ranks)} ranks{where} ready in {seconds:.1f} s"
    notes = [note for note in (sharing_note(ranks), spares_note(spare_pids)) if note]
    return StatusTable(["rank", "host", "pid", "device", "backend", "transport"], rows,
                       caption, " ".join(notes))


def spares_note(pids) -> str:
    """One line for the hot spares (``--spares``): how many wait, and the memory of their
    own each holds (its pages not shared with the fork server it came from) where they run
    on this host; empty when there are none."""
    if not pids:
        return ""
    own = []
    for pid in pids:
        try:
            own.append(psutil.Process(pid).memory_full_info().uss)
        except (psutil.Error, OSError):  # on another host, or gone
            pass
    each = f", {max(own) / 2**20:.0f} MiB of its own each" if own else ""
    count = len(pids)
    return (f"{count} hot spare{'s' * (count > 1)} wait{'s' * (count == 1)} to take a dead "
            f"rank's place (pid {', '.join(map(str, pids))}{each}).")


#: What each way of sharing a GPU costs (``RankInfo.gpu_sharing``), in the start table's
#: words; the figures are docs/gpus.md's (2 ranks on one H100).
SHARING_COSTS = {
    "nccl": "CUDA tensors travel by NCCL's shared mode (NCCL_MULTI_RANK_GPU_ENABLE)",
    "nccl-hostid": "CUDA tensors travel by NCCL over its socket transport, each rank posing "
                   "as a host of its own (NCCL_HOSTID: this NCCL has no shared mode; a 64 MB "
                   "allreduce took 37 ms on an H100)",
    "gloo": "CUDA tensors travel by gloo through host memory (a 64 MB allreduce took 42 ms "
            "on an H100; NCCL 2.30 or later would share the GPU directly)",
    "mpi": "CUDA tensors travel by ipydist's MPI backend through host memory",
}


def sharing_note(ranks: list[RankInfo]) -> str:
    """One line for ranks that share GPUs (empty when none do): how many on how many GPUs of
    which host, and how their CUDA tensors travel, with what that costs."""
    by_host: dict[str, list[RankInfo]] = {}
    for info in ranks:
        if info.gpu_sharing:
            by_host.setdefault(info.host, []).append(info)
    if not by_host:
        return ""
    way = next(iter(by_host.values()))[0].gpu_sharing  # the first host's, for the cost
    shapes = {(len(infos), len({i.device for i in infos}), infos[0].gpu_sharing)
              for infos in by_host.values()}
    if len(shapes) == 1:
        ((count, gpus, _),) = shapes
        where = (f"on {next(iter(by_host))}" if len(by_host) == 1
                 else f"on each of {len(by_host)} hosts")
        share = f"{count} ranks share {gpus} GPU{'s' if gpus > 1 else ''} {where}"
    else:
        share = "; ".join(f"{len(infos)} ranks share {len({i.device for i in infos})} "
                          f"GPU(s) on {host}" for host, infos in by_host.items())
    return (f"{share}, dealt round-robin (they take turns on each GPU): "
            f"{SHARING_COSTS.get(way, way)}.")


def status_table(ranks: list[RankInfo], states: dict[int, str], memory: dict[int, str],
          death: Death | None = None, report: str = "",
          launcher: str = "mpiexec", healing: str = "") -> StatusTable:
    """The table of ``ranks`` (rank infos, in the order shown) in ``states`` (``"idle"``,
    ``"busy"`` or ``"dead"`` by rank), with each live rank's ``memory``; ``death`` is the rank
    that died first and how (:func:`~ipydist.notebook.launch.deaths.find_death`), ``report``
    the sentence that says so and what to do next."""
    dead = sorted(r for r, state in states.items() if state == "dead")
    rows = []
    for info in ranks:
        rank = info.rank
        state = states[rank]
        if state == "dead":
            state = _dead_state(rank, death, len(dead), launcher)
        shown = NO_MEMORY if states[rank] == "dead" else memory.get(rank) or NO_MEMORY
        rows.append([rank, info.host, info.pid, info.device, state, shown])
    caption = f"{len(ranks)} ranks"
    if dead:
        caption += f"; {describe_ranks(dead)} dead"
    if replaced := sorted(i.rank for i in ranks if i.replacement):
        caption += (f"; {describe_ranks(replaced)} "
                    f"{'is a replacement' if len(replaced) == 1 else 'are replacements'}")
    return StatusTable(COLUMNS, rows, caption, healing or (report if dead else ""))


def _dead_state(rank: int, death: Death | None, dead: int, launcher: str) -> str:
    if death is None:
        return "dead"
    if rank != death.rank:
        return f"stopped by {launcher}"
    first = "died first" if dead > 1 else "died"
    return f"{first}: {death.short()}" if death.short() else first


def grouped_by_host(ranks: list[RankInfo]) -> list[RankInfo]:
    """Rank infos with each host's ranks together (hosts in the order their first rank comes),
    in rank order within a host: how a table of ranks across hosts reads best."""
    first: dict[str, int] = {}
    for info in ranks:
        first.setdefault(info.host, info.rank)
    return sorted(ranks, key=lambda i: (first[i.host], i.rank))
