"""The contract between the notebook side and the ranks: stdlib only, imported by both.

Everything that crosses from one side to the other is named here, once:

- :class:`RankConfig`: what ``%dist_start`` tells every rank, as ``IPYDIST_*`` environment
  variables that mpiexec forwards (the ranks read them back before anything else runs);
- the data-message keys a rank sends on its IOPub channel (metrics, collective waits), and the
  metric batch format (:func:`to_columns`);
- the prefix of the one-line message a rank prints when it cannot start, and the marker lines
  (:func:`phase_line`) by which a starting rank reports its progress;
- the signal the notebook sends to release a rank;
- :class:`RankCall` and :func:`on_rank`: the functions of ``ipydist.rank.calls`` the notebook
  calls, declared once with their replies' types, and how it calls them on the ranks without
  importing rank code (which imports torch) into the kernel; the typed records those calls
  reply with (:class:`RankInfo`, :class:`RecoveryReport`, :class:`HealReport`), which the
  notebook reads by field;
- where the ranks' timeline goes by default (:data:`TIMELINE_FILE`).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

#: A rank call's reply type (:class:`RankCall`).
R = TypeVar("R")

# --- notebook -> rank: the environment every rank starts with ---------------------------------

GPUS_ENV = "IPYDIST_GPUS"
#: How many GPUs each rank sees (``--gpus-per-rank``; 1 when unset).
GPUS_PER_RANK_ENV = "IPYDIST_GPUS_PER_RANK"
BACKEND_ENV = "IPYDIST_BACKEND"
#: What ``--backend mpi`` gives: ipydist's torch.distributed backend over mpi4py, by this name.
MPI_BACKEND = "mpi4py"
TRANSPORT_ENV = "IPYDIST_TRANSPORT"
INIT_ENV = "IPYDIST_INIT"
#: Seconds a collective may wait before it raises (torch's process-group timeout); users set it
#: with ``--env IPYDIST_PG_TIMEOUT=S``.
PG_TIMEOUT_ENV = "IPYDIST_PG_TIMEOUT"
#: Overrides the address ranks use for the process-group rendezvous (``--env``).
MASTER_ADDR_ENV = "IPYDIST_MASTER_ADDR"
#: Across hosts: the notebook host's address on the network the ranks share. Each rank binds
#: gloo/NCCL to its own interface that reaches it, and rank 0 offers its address there.
NOTEBOOK_ADDR_ENV = "IPYDIST_NOTEBOOK_ADDR"
#: On one host: the folder rank 0 makes its rendezvous file in, the cluster's profile folder,
#: which the notebook removes when the cluster stops (ranks end by signal, where an atexit of
#: rank 0's would not run: every cluster left a folder in /tmp).
RENDEZVOUS_PARENT_ENV = "IPYDIST_RENDEZVOUS_PARENT"
#: ``0`` turns off the check that every rank calls the same collective with the same shapes
#: and dtypes before its data moves (``ipydist.torch._wire.call_check``); users set it with
#: ``--env``.
CHECK_COLLECTIVES_ENV = "IPYDIST_CHECK_COLLECTIVES"
#: The name of the cluster's fork servers, one per host, which import torch once and fork the
#: host's ranks (``ipydist.rank.start.forkserver``); ``0`` (``--env IPYDIST_FORKSERVER=0``): every
#: rank imports torch itself.
FORKSERVER_ENV = "IPYDIST_FORKSERVER"
#: Given only to a fork server the notebook keeps between its clusters: the descriptor of the
#: pipe whose closing (the notebook's process ended) ends the server.
FORKSERVER_OWNER_ENV = "IPYDIST_FORKSERVER_OWNER"
#: How many of mpiexec's processes are hot spares (``--spares N``): the last N of its world,
#: which wait to take a dead rank's place (``ipydist.rank.healing.spares``).
SPARES_ENV = "IPYDIST_SPARES"
DEFAULT_PG_TIMEOUT = 600.0


#: The first NCCL that lets several ranks of one communicator use the same GPU, when
#: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (before it, NCCL refuses: "Duplicate GPU detected"): the
#: ranks' choice of how CUDA tensors travel when they share GPUs, and ``ipydist doctor``'s.
NCCL_SHARED_MODE = (2, 30)


@dataclass(frozen=True)
class RankConfig:
    """What every rank is told at start; :meth:`to_env` and :meth:`from_env` are inverses."""

    #: ``auto``, ``none`` or a comma-separated list of GPU indices (as ``--gpus`` takes it).
    gpus: str = "auto"
    #: How many of them each rank sees (``--gpus-per-rank``): the host's GPUs are dealt out
    #: in local-rank order, N to a rank, through each rank's ``CUDA_VISIBLE_DEVICES``.
    gpus_per_rank: int = 1
    #: ``auto``, ``nccl``, ``gloo`` or ``mpi`` (as ``--backend`` takes it).
    backend: str = "auto"
    #: ``auto``, ``mpi``, ``hierarchical`` or ``gloo``: the wire of ipydist's collectives on
    #: CPU tensors.
    transport: str = "auto"
    #: Whether the bootstrap creates the default process group (``--no-init``: False).
    init: bool = True
    pg_timeout: float = DEFAULT_PG_TIMEOUT
    #: Empty: the bootstrap finds rank 0's address itself.
    master_addr: str = ""
    #: Empty on one host; across hosts, see NOTEBOOK_ADDR_ENV.
    notebook_addr: str = ""
    #: How many processes beyond the ranks mpiexec starts as hot spares (``--spares``).
    spares: int = 0

    def to_env(self) -> dict[str, str]:
        env = {GPUS_ENV: self.gpus, BACKEND_ENV: self.backend, INIT_ENV: "1" if self.init else "0"}
        if self.gpus_per_rank != 1:
            env[GPUS_PER_RANK_ENV] = str(self.gpus_per_rank)
        if self.transport != "auto":
            env[TRANSPORT_ENV] = self.transport
        if self.pg_timeout != DEFAULT_PG_TIMEOUT:
            env[PG_TIMEOUT_ENV] = f"{self.pg_timeout:g}"
        if self.master_addr:
            env[MASTER_ADDR_ENV] = self.master_addr
        if self.notebook_addr:
            env[NOTEBOOK_ADDR_ENV] = self.notebook_addr
        if self.spares:
            env[SPARES_ENV] = str(self.spares)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankConfig:
        env = os.environ if env is None else env
        return cls(
            gpus=env.get(GPUS_ENV, "auto"),
            gpus_per_rank=int(env.get(GPUS_PER_RANK_ENV) or 1),
            backend=env.get(BACKEND_ENV, "auto"),
            transport=env.get(TRANSPORT_ENV, "auto"),
            init=env.get(INIT_ENV, "1") == "1",
            pg_timeout=float(env.get(PG_TIMEOUT_ENV) or DEFAULT_PG_TIMEOUT),
            master_addr=env.get(MASTER_ADDR_ENV, ""),
            notebook_addr=env.get(NOTEBOOK_ADDR_ENV, ""),
            spares=int(env.get(SPARES_ENV) or 0),
        )


# --- what the notebook side reads from its own environment -----------------------------------

#: The mpiexec to use when ``--mpi`` is not given.
MPIEXEC_ENV = "IPYDIST_MPIEXEC"
#: The ipyparallel engines' log level (default WARN; DEBUG for detail).
ENGINE_LOG_LEVEL_ENV = "IPYDIST_ENGINE_LOG_LEVEL"
DEFAULT_ENGINE_LOG_LEVEL = "WARN"
#: Set by ``ipydist install-kernel --np N``: the ranks the kernel starts on first use.
KERNEL_NP_ENV = "IPYDIST_KERNEL_NP"

# --- rank -> notebook ------------------------------------------------------------------------

#: How a rank runs: ``python -m ipydist.rank``, then ipyparallel's engine arguments.
RANK_MODULE = "ipydist.rank"
#: A host's fork server: ``python -m ipydist.rank.start.forkserver``; a notebook starts the one
#: it keeps on its host, a rank's stub the one of its cluster elsewhere.
FORKSERVER_MODULE = "ipydist.rank.start.forkserver"
#: Start of the one-line message a rank prints when it cannot start
#: (``ipydist: rank 1 on HOST: what to fix``); the notebook shows these lines first.
ERROR_PREFIX = "ipydist: rank"
#: A starting rank has no channel to the notebook until its engine registers; what it has is
#: its stdout, which mpiexec forwards from every host into the output the notebook reads. So it
#: prints one marker line per step of its start (:func:`phase_line`), and the notebook shows
#: the steps as they happen and leaves these lines out of all it shows of that output.
PHASE_MARKER = "ipydist-phase:"
#: The steps, in order: torch imported; then the default process group made, or, where the
#: user's code makes it (``--no-init``), the torchrun variables set instead.
PHASE_TORCH = "torch"
PHASE_GROUP = "group"
PHASE_ENV = "env"
_PHASE = re.compile(
    re.escape(PHASE_MARKER) + rf" (\d+) ({PHASE_TORCH}|{PHASE_GROUP}|{PHASE_ENV})\b")
#: Data-message key prefix of a metrics batch from ``hvd.log()`` (see :func:`to_columns`).
#: Each batch has its own key, ``ipydist.metrics.<seq>`` (:func:`metrics_key`): ipyparallel
#: keeps only the latest value of a key in a request's metadata, and batches that arrive before
#: the notebook hooks into a cell's output (a busy notebook can take a while after sending the
#: cell) are found only there, so each must stay until the notebook takes it.
METRICS_KEY = "ipydist.metrics"


def metrics_key(seq: int) -> str:
    """The data-message key of metrics batch ``seq``."""
    return f"{METRICS_KEY}.{seq}"


def is_metrics_key(key: str) -> bool:
    return key.startswith(METRICS_KEY + ".")


#: Data-message key of "waiting in collective X for N s" / "no longer waiting" reports.
STATE_KEY = "ipydist.state"
#: Data-message key of a rank's vitals, once a second while its cell runs (see
#: ``ipydist.rank.vitals``): what it does, CPU %, RSS, GPU use, last step time.
VITALS_KEY = "ipydist.vitals"
#: Data-message key of ``"started"`` / ``"ended"``, sent as a rank begins and ends a cell's
#: code (the end before the reply: the notebook can tell a lost reply from a busy rank).
CELL_KEY = "ipydist.cell"
#: Key, in a cell's execute request metadata, of the notebook's number of the cell (``In [N]``),
#: which the rank takes as its own so that a traceback's ``Cell In[N]`` is the cell one sees.
CELL_NUMBER_KEY = "ipydist.cell_number"
#: Key, in a cell's execute request metadata, of the ranks whose ``breakpoint()`` stops at a
#: pdb prompt in the notebook (a list), or None where nobody can type (a headless run).
DEBUG_RANKS_KEY = "ipydist.debug_ranks"
#: Data-message key of a rank's pdb, stopped in a cell: ``{"seq", "rank", "output"}`` and
#: ``"prompt"`` (it waits for a command) or ``"ended": True`` (the cell goes on).
DEBUG_KEY = "ipydist.debug"

#: Data-message key of a heal's copy (rank 0 sends it while the state's tensors travel to the
#: replacements): (bytes sent, of how many), at most twice a second, so that the notebook
#: sees the copy move, ends it only when it stops moving, and ``%dist_status`` says how far it
#: is (:mod:`ipydist.notebook.failures.healing`).
HEAL_PROGRESS_KEY = "ipydist.heal_progress"
#: The start of the name of a heal's shared-memory file (``ipydist.rank.healing.state_transfer``),
#: followed by the writing rank's pid: rank 0 removes it when the copy ends, and the notebook
#: removes what a rank killed in the middle of one left, when it stops the cluster.
HEAL_FILE_PREFIX = "ipydist-heal-"
#: Where that file goes: ``--env IPYDIST_HEAL_SHARED_MEMORY=DIR`` (``none``: over MPI).
HEAL_SHARED_MEMORY = "/dev/shm"
HEAL_SHARED_MEMORY_VARIABLE = "IPYDIST_HEAL_SHARED_MEMORY"
#: Why a heal or a grow on one host starts no new rank once its hot spares are used up, as
#: both sides say it (the ranks' heal, the notebook's check before a grow).
NO_SPAWN_ON_ONE_HOST = ("on one host the ranks' MPI starts no new process unless --elastic is "
                        "asked for (it opens MPI's TCP port)")

#: The message types of the notebook's questions on an engine's control channel, which a
#: rank answers while its cell runs (see ``ipydist.rank.introspection.control``), and of the
#: answers.
CONTROL_REQUEST = "ipydist_request"
CONTROL_REPLY = "ipydist_reply"

# A metrics batch is a dict:
#   "seq": int             batch number on this rank, from 0 (the notebook orders by it)
#   "points": dict         rank 0's points as columns (see to_columns); empty on other ranks
#   "timing": tuple        (steps, sum of step seconds, longest step, seconds in collectives)
#   "total", "batch_size"  what the cell's log() calls said, or None
#   "sent": float          time.time() when it was sent


def to_columns(points: list[tuple[float, float, dict[str, float]]]) -> dict[str, Any]:
    """``[(step, time, {name: value}), ...]`` as columns of doubles, NaN where a point did not
    have a metric: ``{"step": array, "time": array, "values": {name: array}}``.

    Arrays travel as raw bytes and the notebook side appends them in one call each, so a
    batch of 100,000 points costs little to send, unpack and store.
    """
    n = len(points)
    values: dict[str, array[float]] = {}
    for i, (_, _, metrics) in enumerate(points):
        for name, v in metrics.items():
            column = values.get(name)
            if column is None:
                column = values[name] = array("d", [float("nan")]) * n
            column[i] = v
    return {"step": array("d", [p[0] for p in points]),
            "time": array("d", [p[1] for p in points]), "values": values}


def phase_line(rank: int, phase: str) -> str:
    """The marker line (without its newline) by which ``rank`` says it got past ``phase``."""
    return f"{PHASE_MARKER} {rank} {phase}"


def parse_phase(line: str) -> tuple[int, str] | None:
    """(rank, phase) of a marker line, or None. The marker is looked for anywhere in the line,
    so prefixes that mpiexec adds (``--tag-output``, ``-prepend-rank``) do not hide it."""
    m = _PHASE.search(line)
    return (int(m.group(1)), m.group(2)) if m else None


# --- notebook -> rank, while the cluster runs -------------------------------------------------

#: Sent to a rank's process to release it from what it waits in (see ``ipydist.rank.watcher``).
RELEASE_SIGNAL = signal.SIGUSR1
#: A recovery (``ipydist.rank.calls.recover``) after a failed or interrupted cell: every rank
#: must have joined it by ARRIVE seconds after it took the request, rebuilt the process group
#: by REBUILD, and checked its tensors by RESYNC; a rank late for a step gives up. The
#: notebook waits RECOVERY_WAIT_SECONDS for the replies, more than a rank can take.
RECOVERY_ARRIVE_SECONDS = 10.0
RECOVERY_REBUILD_SECONDS = 20.0
RECOVERY_RESYNC_SECONDS = 30.0
RECOVERY_WAIT_SECONDS = RECOVERY_RESYNC_SECONDS + 10.0
#: The module whose functions the notebook calls on the ranks through :func:`on_rank`.
RANK_CALLS = "ipydist.rank.calls"


# --- rank -> notebook: the replies of ipydist.rank.calls, read by field --------------------------


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the notebook about itself (``calls.info``): the start table, the
    status, the live view, the death reports and the heal read these fields.
    ``Session.ranks`` gives them to users as dicts (:meth:`as_dict`)."""

    rank: int
    size: int
    host: str
    pid: int
    device: str = "cpu"
    backend: str = "(none)"
    transport: str = ""
    #: How CUDA tensors travel when the ranks of its host share GPUs ("" when this rank has
    #: a GPU of its own, or none): "nccl", "nccl-hostid", "gloo" or "mpi".
    gpu_sharing: str = ""
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    #: The process its launcher started (a stub, where the fork server forked this rank).
    launched_pid: int | None = None
    #: OMP_NUM_THREADS as the rank runs with it (0: not set).
    threads: int = 0
    #: ipyparallel's nanny process watching this rank's engine (None: no nanny).
    nanny_pid: int | None = None
    #: Set by the notebook when this rank replaced one that died (``--elastic``).
    replacement: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (``Session.ranks``: one per rank, as documented)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class RecoveryReport:
    """One rank's reply to ``calls.recover``, after a failed or interrupted cell."""

    #: What the release found the rank doing (the watcher's report), None if not released.
    release: dict[str, Any] | None = None
    #: The process group was rebuilt (on every rank: they decide together).
    rebuilt: bool = False
    #: How many tensors differed between ranks and were copied from rank 0.
    fixed: int = 0
    #: Why the recovery gave up (the same on every rank that heard), None if it did not.
    failed: str | None = None
    #: After a rebuild: the rank's DistributedDataParallel models that now use the new group,
    #: and what could not follow it (each name with what to do), whose next use says so.
    followed: tuple[str, ...] = ()
    marked: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealReport:
    """One rank's reply to a heal (``--elastic``), a resize (``Session.scale``), the state
    copy after either, or the follow-up on a rank that stayed: what the notebook says of it."""

    #: The rank's number in the new world (None: a reply that does not say).
    rank: int | None = None
    #: Resize: the rank left the world (its process ends).
    left: bool = False
    seconds: float = 0.0
    #: Heal: why MPI could not start a replacement (the survivors went on without it).
    not_replaced: str | None = None
    #: Samplers and optimizers of the rank's variables that now follow the new world.
    rebound: tuple[str, ...] = ()
    #: Process sets removed, as a rank in them is gone.
    sets_removed: tuple[str, ...] = ()
    #: State copy, on the rank copied from: the bytes it sent, the variables not copied (each
    #: with why: it does not pickle, or did not load on a new rank), and the user's modules a
    #: new rank could not import, sent by value.
    bytes: int = 0
    skipped: tuple[str, ...] = ()
    by_value: tuple[str, ...] = ()
    #: Heal or resize, on a rank that stayed: its DDP models that now use the new group, and
    #: what could not follow it (each name with what to do), whose next use says so.
    followed: tuple[str, ...] = ()
    marked: tuple[str, ...] = ()
    #: State copy, on the rank copied from: the bytes of those that went from GPU to GPU.
    on_device: int = 0
    #: State copy, on a new rank: why loading the variables failed.
    failed: str | None = None
    #: Heal or resize: the pids of the hot spares still waiting (``--spares``).
    spares: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankCall(Generic[R]):
    """A function of ``ipydist.rank.calls`` that the notebook calls, declared once: its name
    there and the type of its reply (``R``; ``reply`` says it at run time). The notebook calls
    the ranks only by these (``Cluster.call``, :func:`on_rank`), so that the type check knows
    each reply's type, and ``tests/logic/test_rank_calls.py`` holds the rank side to the table:
    a call the ranks lack, or whose reply differs, fails there, not in a user's cell."""

    name: str
    reply: Any

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Sent to the ranks by name: they look it up in their own table."""
        return _call_named, (self.name,)


def _call_named(name: str) -> RankCall[Any]:
    return RANK_CALL_TABLE[name]


ATTACH: RankCall[RankInfo] = RankCall("attach", RankInfo)
SPARES: RankCall[tuple[int, ...]] = RankCall("spares", tuple[int, ...])
RECOVER: RankCall[RecoveryReport] = RankCall("recover", RecoveryReport)
HEAL: RankCall[HealReport] = RankCall("heal", HealReport)
LEAVE: RankCall[HealReport] = RankCall("leave", HealReport)
RESIZE: RankCall[HealReport] = RankCall("resize", HealReport)
RESIZED: RankCall[HealReport] = RankCall("resized", HealReport)
COPY_STATE: RankCall[HealReport] = RankCall("copy_state", HealReport)
ELASTIC_RESET: RankCall[int] = RankCall("elastic_reset", int)
DEBUG: RankCall[dict[str, Any]] = RankCall("debug", dict[str, Any])
ERROR_FRAMES: RankCall[str] = RankCall("error_frames", str)
TIMELINE: RankCall[list[dict[str, Any]] | None] = RankCall("timeline",
                                                           list[dict[str, Any]] | None)
#: Every call, by name.
RANK_CALL_TABLE: dict[str, RankCall[Any]] = {c.name: c for c in (
    ATTACH, SPARES, RECOVER, HEAL, LEAVE, RESIZE, RESIZED, COPY_STATE, ELASTIC_RESET, DEBUG,
    ERROR_FRAMES, TIMELINE)}


def on_rank(call: RankCall[R], *args: Any) -> R:
    """Run ``ipydist.rank.calls.<call.name>(*args)``; the notebook sends this function through
    ipyparallel's ``apply``, so only this module, not rank code, is imported in the kernel."""
    reply: R = getattr(importlib.import_module(RANK_CALLS), call.name)(*args)
    return reply


# --- the timeline ----------------------------------------------------------------------------
#: The lanes of a rank's row in a timeline: its collectives' data, and their call checks.
TIMELINE_DATA_LANE, TIMELINE_CHECK_LANE = 1, 2
#: How a call check's event is named in the trace: ``NEGOTIATE_ALLREDUCE``, Horovod's name for
#: the phase, kept there for the tools that read Horovod's timelines (the notebook shows
#: "allreduce call check").
TIMELINE_CHECK_PREFIX = "NEGOTIATE_"
#: Where the ranks' timeline goes when no path is named (``%dist_timeline``, a rank's
#: ``hvd.start_timeline()`` started by the notebook): one Chrome trace in the working directory.
TIMELINE_FILE = "ipydist-timeline.json"


def chrome_trace(per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Every rank's timeline events (Chrome trace "X" events, without a pid) as one Chrome
    trace: one process per rank, with its lanes named. Loadable in chrome://tracing and
    https://ui.perfetto.dev."""
    trace: list[dict[str, Any]] = []
    for rank, mine in enumerate(per_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank,
                      "args": {"name": f"rank {rank}"}})
        for lane, label in ((TIMELINE_DATA_LANE, "data"), (TIMELINE_CHECK_LANE, "call check")):
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane,
                          "args": {"name": label}})
        trace.extend({**e, "pid": rank} for e in mine)
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_json(path: str, value: object) -> None:
    """Write ``value`` as JSON atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)
