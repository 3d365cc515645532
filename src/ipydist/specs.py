"""Every value a user types (``--np``, ``--ranks``, ``--gpus``, ``--backend``, seconds,
``--env``), parsed and validated here once, for the magics, ``Session``, the ``ipydist`` command
and the ranks alike. Stdlib only (and the error base): both sides of the wire import it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

from ipydist.error_base import IpydistError

_RANGE = re.compile(r"^(\d+)-(\d+)$")


class SpecError(IpydistError, ValueError):
    """A spec the user typed is malformed or out of range; the message says how to fix it."""


def parse_ranks(spec: str | int | list[int] | None, size: int) -> list[int]:
    """Ranks named by ``--ranks``: ``0``, ``0,2``, ``1-3`` or a mix; None means all ranks."""
    if spec is None:
        return list(range(size))
    if isinstance(spec, int):
        parts: list[str] = [str(spec)]
    elif isinstance(spec, list | tuple | range):
        parts = [str(int(r)) for r in spec]
    else:
        parts = [p.strip() for p in str(spec).split(",")]
    ranks: list[int] = []
    for part in parts:
        m = _RANGE.match(part)
        if part.isdigit():
            ranks.append(int(part))
        elif m and int(m.group(1)) <= int(m.group(2)):
            ranks.extend(range(int(m.group(1)), int(m.group(2)) + 1))
        else:
            raise SpecError(
                f"--ranks {spec}: expected a rank (0), a list (0,2) or a range (1-3)."
            )
    outside = [r for r in ranks if r >= size]
    if outside:
        raise SpecError(
            f"--ranks {spec}: this cluster has ranks 0-{size - 1}; "
            f"{format_ranks(outside)} {'does' if len(outside) == 1 else 'do'} not exist."
        )
    return sorted(set(ranks))


def format_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: short, and the inverse of :func:`parse_ranks`."""
    ranks = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(runs)


def describe_ranks(ranks: Iterable[int]) -> str:
    """``"rank 1"``, ``"ranks 0-3"``, ``"ranks 0-1 and 3"`` or ``"ranks 0-2, 5 and 7"``, for
    messages: runs as :func:`format_ranks` writes them, joined as a sentence would, since a
    bare ``0-1,3`` reads as a range to 3 and wraps inside the list."""
    runs = format_ranks(ranks).split(",")
    if len(runs) == 1 and "-" not in runs[0]:
        return f"rank {runs[0]}"
    listed = runs[0] if len(runs) == 1 else f"{', '.join(runs[:-1])} and {runs[-1]}"
    return f"ranks {listed}"


def parse_env(pairs: list[str] | dict[str, str] | None) -> dict[str, str]:
    """``["K=V", ...]`` from ``--env`` into a dict, rejecting anything that is not K=V."""
    if not pairs:
        return {}
    if isinstance(pairs, dict):
        return {str(k): str(v) for k, v in pairs.items()}
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise SpecError(
                f"--env {pair}: expected NAME=VALUE, for example --env NCCL_DEBUG=INFO."
            )
        env[name] = value
    return env


def parse_np(value: str | int, option: str = "--np") -> int:
    """A number of ranks: a whole number of at least 1 (``"4"``, ``4``; not ``4.5`` or ``True``)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(value, bool) or n < 1 or str(value).strip() not in (str(n), f"+{n}"):
        raise SpecError(
            f"{option} {value}: the number of ranks must be a whole number of at least 1.")
    return n


def parse_count(value: str | int, option: str) -> int:
    """A count that may be 0 (``--spares``): a whole number of at least 0."""
    try:
        return 0 if str(value).strip() in ("0", "+0") else parse_np(value, option)
    except SpecError:
        raise SpecError(f"{option} {value}: give a whole number of at least 0.") from None


def parse_seconds(value: str | float, option: str, zero: bool = False) -> float:
    """A number of seconds above 0 (or exactly 0, meaning "off", when ``zero`` is allowed)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds < 0 or (seconds == 0 and not zero) or seconds != seconds:
        off = ", or 0 to turn it off" if zero else ""
        shown = f"{value:g}" if isinstance(value, float) else value
        raise SpecError(f"{option} {shown}: expected a number of seconds above 0{off}.")
    return seconds


def parse_gpus(spec: str | list[int] | None) -> str | list[int]:
    """``"auto"``, ``"none"`` or a list of GPU indices, from ``--gpus``."""
    if spec is None:
        return "auto"
    if isinstance(spec, list):
        return [int(i) for i in spec]
    text = str(spec).strip().lower()
    if text in ("auto", "none"):
        return text
    try:
        indices = [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        indices = []
    if not indices or any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise SpecError(
            f"--gpus {spec}: expected auto, none, or a list of distinct GPU indices like 0,1."
        )
    return indices


def parse_gpus_per_rank(value: str | int) -> int:
    """``--gpus-per-rank``: how many GPUs each rank sees, a whole number of at least 1."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = None
    if n is None or isinstance(value, bool) or n < 1 or str(value).strip() not in (str(n), f"+{n}"):
        raise SpecError(f"--gpus-per-rank {value}: expected a whole number of GPUs of at least "
                        "1 (1, the default: one GPU per rank).")
    return n


def format_gpus(gpus: str | list[int]) -> str:
    """The inverse of :func:`parse_gpus`, for the rank environment."""
    return gpus if isinstance(gpus, str) else ",".join(map(str, gpus))


def _one_of(value: str, option: str, choices: tuple[str, ...], expected: str) -> str:
    """``value`` if it is one of ``choices``; else a SpecError saying what ``option`` takes."""
    if value not in choices:
        raise SpecError(f"{option} {value}: expected {expected}.")
    return value


#: ``--backend`` values: ``mpi`` is ipydist's torch.distributed backend over mpi4py
#: (``ipydist.torch._mpi.backend``).
BACKENDS = ("auto", "nccl", "gloo", "mpi")
#: ``--transport`` values: the wire of ipydist's collectives on CPU tensors.
TRANSPORTS = ("auto", "mpi", "hierarchical", "gloo")
#: ``--launcher`` values: mpiexec (also over ssh), or Slurm's srun (and salloc).
LAUNCHERS = ("mpiexec", "slurm")


def parse_backend(backend: str) -> str:
    return _one_of(backend, "--backend", BACKENDS,
                   "auto, nccl, gloo or mpi (auto: NCCL when ranks have GPUs, else gloo)")


def parse_transport(transport: str) -> str:
    return _one_of(transport, "--transport", TRANSPORTS,
                   "auto (MPI for CPU tensors when mpiexec or srun started the ranks, "
                   "hierarchical across hosts), mpi (flat), hierarchical or gloo")


def parse_launcher(launcher: str) -> str:
    return _one_of(launcher, "--launcher", LAUNCHERS,
                   "mpiexec (the default; also across hosts over ssh) or slurm (srun in this "
                   "Slurm allocation, or salloc for a new one)")


#: A host name or address as MPI launchers accept it (letters, digits, ``.-_``, IPv4).
_HOST = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``--hosts nodeA:4,nodeB:4`` as ``[("nodeA", 4), ("nodeB", 4)]``, Horovod's ``-H``
    syntax: a host without ``:N`` has one slot; a host named twice adds up its slots."""
    hosts: dict[str, int] = {}
    for part in str(spec).split(","):
        name, sep, slots = part.strip().partition(":")
        if not _HOST.match(name) or (sep and not slots.isdigit()) or (sep and int(slots) < 1):
            raise SpecError(
                f"--hosts {spec}: expected host names with slot counts, such as "
                "nodeA:4,nodeB:4 (a host without :N gets one slot).")
        hosts[name] = hosts.get(name, 0) + (int(slots) if sep else 1)
    return list(hosts.items())


def parse_hostfile(text: str, source: str = "--hostfile") -> list[tuple[str, int]]:
    """A hostfile in Open MPI's syntax (``nodeA slots=4``) or MPICH's (``nodeA:4``), one host
    per line, ``#`` comments; a host without a slot count has one slot, as in MPICH."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        name, sep, slots = words[0].partition(":")
        count = int(slots) if sep and slots.isdigit() else None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "max_slots", "max-slots") and value.isdigit():
                count = int(value) if key == "slots" or count is None else count
            else:
                count = -1
        if not _HOST.match(name) or (sep and count is None) or (count is not None and count < 1):
            raise SpecError(
                f"{source}, line {number}: {raw.strip()!r} is not a host line; expected "
                "'nodeA slots=4' (Open MPI) or 'nodeA:4' (MPICH).")
        hosts[name] = hosts.get(name, 0) + (count or 1)
    if not hosts:
        raise SpecError(f"{source}: no host in it; write one host per line, 'nodeA slots=4'.")
    return list(hosts.items())


def format_hosts(hosts: list[tuple[str, int]]) -> str:
    """The inverse of :func:`parse_hosts`: ``nodeA:4,nodeB:4``."""
    return ",".join(f"{name}:{slots}" for name, slots in hosts)


# --- the start options, declared once ---------------------------------------------------------

#: Seconds to wait for every rank to start (``--timeout``).
DEFAULT_START_TIMEOUT = 120.0
#: Warn under a cell when ranks have waited this long in a collective others have not called.
STALL_WARNING_SECONDS = 30.0
#: When a rank fails, how long the others get to finish before they are released.
FAILURE_GRACE = 10.0


def _option(default: object = None, *, help: str, parse: Callable[[Any], Any] | None = None,
            metavar: str | None = None, flag: str | None = "", off: str = "",
            off_help: str = "", many: bool = False) -> Any:
    """One field of :class:`StartOptions`: its default, what it means (``help``, also
    ``%dist_start --help``'s text), how a typed value is checked (``parse``), and how the magic
    spells it: ``flag`` (default: the name with dashes; None: Python only), ``off`` for a
    switch's opposite (``--no-elastic``), ``many`` for an option given several values."""
    metadata = {"help": help, "parse": parse, "metavar": metavar, "flag": flag, "off": off,
                "off_help": off_help, "many": many}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def _maybe(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``parse``, letting None (not given) through."""
    return lambda value: None if value is None else parse(value)


def _text(value: object) -> str:
    return str(value or "")


def _text_or_none(value: object) -> str | None:
    return str(value) if value else None


@dataclass(frozen=True)
class StartOptions:
    """Everything ``%dist_start`` and ``Session(...)`` take, declared once: the magic's parser
    and ``--help``, ``Session``'s keyword arguments and the docs' tables are made from (or
    checked against) these fields. Values are checked when the options are made, so a typo
    fails before anything starts; what depends on the machine (hosts, GPUs, the MPI) is
    decided by the launch plan."""

    np: int | None = _option(
        help="number of ranks (default: the kernel's --np, else one per GPU the cluster may "
        "use: the --gpus list, else CUDA_VISIBLE_DEVICES, else the host's; else one per CPU "
        "core); more ranks than cores or GPUs works: they share them",
        parse=_maybe(parse_np), metavar="N")
    gpus: str | list[int] = _option(
        "auto", help="auto: one GPU per rank, by local rank, when the host has GPUs (more "
        "ranks than GPUs are dealt them round-robin); none: CPU only; a list such as 0,1: "
        "only these GPUs", parse=parse_gpus, metavar="SPEC")
    gpus_per_rank: int = _option(
        1, help="GPUs each rank sees (default: 1): the host's GPUs are dealt out N to a rank, "
        "each rank numbering its own from cuda:0, for a model split across them",
        parse=parse_gpus_per_rank, metavar="N")
    backend: str = _option(
        "auto", help="the torch.distributed backend (DDP's): auto (NCCL when ranks have GPUs, "
        "else gloo; ranks sharing a GPU: NCCL 2.30's shared mode, else gloo), nccl, gloo, or "
        "mpi (ipydist's, over mpi4py: CPU tensors; DDP's step 1.41-1.46x faster than on gloo "
        "on one host)",
        parse=parse_backend, metavar="NAME")
    transport: str = _option(
        "auto", help="the wire of ipydist's collectives on CPU tensors: auto (MPI, where "
        "mpiexec or srun started the ranks: 1.15-88x faster than gloo on one host; across hosts, "
        "hierarchical where ranks are dealt out by node), mpi (flat), hierarchical (forced), "
        "or gloo", parse=parse_transport, metavar="NAME")
    mpi: str | None = _option(
        help="the mpiexec to use (default: $IPYDIST_MPIEXEC, the one next to this Python, then "
        "$PATH); on one host MPICH's starts the ranks with the mpiexec.gforker beside it, "
        "which listens on no port", parse=_text_or_none, metavar="PATH")
    hosts: str | None = _option(
        help="hosts to run on, with slots: nodeA:4,nodeB:4 (a host without :N has one slot; "
        "--np defaults to the slots)", parse=_text_or_none, metavar="SPEC")
    hostfile: str | None = _option(
        help="hosts to run on, one per line: 'nodeA slots=4' (Open MPI) or 'nodeA:4' (MPICH); "
        "inside a Slurm allocation the default is its nodes", parse=_text_or_none,
        metavar="FILE")
    launcher: str = _option(
        "mpiexec", help="mpiexec (default; over ssh across hosts) or slurm: srun in this Slurm "
        "allocation, or outside one salloc for a new allocation, then srun in it",
        parse=parse_launcher, metavar="NAME")
    partition: str | None = _option(
        help="with --launcher slurm outside an allocation: the partition to ask for",
        parse=_text_or_none, metavar="NAME")
    time_limit: str | None = _option(
        help="with --launcher slurm outside an allocation: the job's time limit, as Slurm "
        "writes it (30, 1:00:00, 1-0)", parse=_text_or_none, metavar="LIMIT", flag="--time")
    account: str | None = _option(
        help="with --launcher slurm outside an allocation: the account to charge",
        parse=_text_or_none, metavar="NAME")
    slurm_args: str = _option(
        "", help='with --launcher slurm: extra arguments for salloc (new allocation) or srun '
        '(inside one), e.g. --slurm-args="--nodes=2 --gres=gpu:4"', parse=_text,
        metavar='"..."')
    mpi_args: str = _option(
        "", help='extra mpiexec arguments, written with = and quotes, e.g. '
        '--mpi-args="--hostfile hosts"', parse=_text, metavar='"..."')
    timeout: float = _option(
        DEFAULT_START_TIMEOUT, help="seconds to wait for every rank to start (default: "
        f"{DEFAULT_START_TIMEOUT:g}); a launch that fails sooner ends at once with MPI's own "
        "message", parse=lambda value: parse_seconds(value, "--timeout"), metavar="S")
    env: dict[str, str] = _option(
        {}, help="environment variables for every rank", parse=parse_env, metavar="K=V",
        many=True)
    stall_warning: float = _option(
        STALL_WARNING_SECONDS, help="warn under the cell when ranks have waited S seconds in a "
        "collective that other ranks have not called (default: "
        f"{STALL_WARNING_SECONDS:g}; 0: never)",
        parse=lambda value: parse_seconds(value, "--stall-warning", zero=True), metavar="S")
    elastic: bool | None = _option(
        help="the ranks outlive one that dies, which is replaced with rank 0's variables "
        "(Open MPI's fault tolerance, ULFM; mpiexec only). Default: on where the MPI has it; "
        "on one host with one hot spare and no TCP port, so one death heals; asked for there, "
        "every death heals, as MPI's TCP transport (a port on every interface) lets it start "
        "new ranks",
        parse=_maybe(bool), off="--no-elastic",
        off_help="a rank that dies ends the job, as plain mpiexec does: %%dist_restart then")
    min_np: int | None = _option(
        help="elastic: when a dead rank's replacement cannot be started, go on with the others "
        "if they are at least M (default: as many as started, so never fewer)",
        parse=_maybe(lambda value: parse_np(value, "--min-np")), metavar="M")
    spares: int | None = _option(
        help="elastic: N hot spares beside the ranks, processes with torch imported that take "
        "a dead rank's place in about a second, without starting a new one (default: 1 on one "
        "host, 0 across hosts); with --spares alone on one host, N deaths heal and no TCP port "
        "opens",
        parse=_maybe(lambda value: parse_count(value, "--spares")), metavar="N")
    init: bool = _option(
        True, help="do not create the torch.distributed process group: your code calls "
        "init_process_group itself", parse=bool, flag="--no-init")
    failure_grace: float = _option(
        FAILURE_GRACE, help="when a rank fails, the seconds the others get to finish their "
        "cell before they are released", flag=None,
        parse=lambda value: parse_seconds(value, "failure_grace", zero=True))

    def __post_init__(self) -> None:
        for option in fields(self):
            parse = option.metadata["parse"]
            if parse is not None:
                object.__setattr__(self, option.name, parse(getattr(self, option.name)))

    def changed(self, **given: Any) -> StartOptions:
        """These options with some changed, checked as new ones are; an unknown name is
        refused with the names there are (``Session(nps=4)``)."""
        names = [option.name for option in fields(self)]
        unknown = [name for name in given if name not in names]
        if unknown:
            raise SpecError(f"{', '.join(unknown)}: no such start option; the options are "
                            f"{', '.join(names)}.")
        return replace(self, **given)


def default_of(option: Field[Any]) -> Any:
    """``option``'s default value (a fresh one, where it is made by a factory)."""
    if option.default_factory is not MISSING:
        return option.default_factory()
    return option.default


def flag_of(option: Field[Any]) -> str | None:
    """How ``%dist_start`` spells ``option`` (None: a Python-only option)."""
    flag: str | None = option.metadata["flag"]
    return ("--" + option.name.replace("_", "-")) if flag == "" else flag
