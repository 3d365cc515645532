"""A collective call's signature as a few integers, the same in every process, and the
verdict on every rank's signatures: what :mod:`ipydist.torch._wire.call_check` exchanges before a
collective's data moves. Pure functions: every rank reaches the same verdict from the same
headers."""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Sequence

import torch

from ipydist.specs import describe_ranks

#: The kinds of call that are checked; a header holds a kind's position here, plus one.
KINDS = ("allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
         "barrier", "broadcast_parameters", "optimizer step", "alltoall", "reducescatter",
         "join", "grouped allreduce", "add_process_set", "remove_process_set")

# Where each field sits in a header. Shapes longer than MAX_DIMS keep their first dims and a
# CRC-32 of the rest (CRC, not hash(): it must be the same number in every process).
MAX_DIMS = 6
KIND, DTYPE, DEVICE, NDIM = 0, 1, 2, 3
DIMS = slice(4, 4 + MAX_DIMS)
MORE_DIMS = 4 + MAX_DIMS
OP, ROOT, PRESCALE, POSTSCALE, EXTRA, CARRIED, FLAGS = range(MORE_DIMS + 1, MORE_DIMS + 8)
HEADER_WORDS = FLAGS + 1
JOIN = KINDS.index("join") + 1
BARRIER = KINDS.index("barrier") + 1
#: A flag: the call was started by an ``*_async`` function, so a barrier may let it pass.
DEFERRABLE = 1
#: The calls a rank waiting in ``hvd.join()`` takes part in (with a neutral tensor), knowing
#: all it needs from their header.
SERVED_BY_JOINED = ("allreduce", "optimizer step", "barrier")

ADVICE = ("Every rank must call the same collectives, in the same order, with the same shapes "
          "and dtypes.")

#: What the shape field is, for kinds where it is not simply the tensor's shape.
_SHAPE_LABELS = {
    "allgather": "tensor shapes (after the first dimension)",
    "broadcast_parameters": "sizes (elements per dtype)",
    "optimizer step": "gradient bucket sizes",
    "grouped allreduce": "numbers of tensors",
    "add_process_set": "numbers of ranks",
    "remove_process_set": "numbers of ranks",
}
#: What the extra word stands for, for the kinds that use it.
_EXTRA_LABELS = {
    "broadcast_parameters": "parameter dtypes",
    "optimizer step": "gradient bucket plans (dtypes, devices or compression)",
    "grouped allreduce": "the tensors' dtypes, devices or shapes",
    "add_process_set": "ranks",
    "remove_process_set": "ranks",
}

#: text -> CRC-32, and back: names travel as numbers and are shown as names again.
_codes: dict[str, int] = {}
_names: dict[int, str] = {}
#: Codes of dtypes, device types and ops already seen (a header is built on every call).
_known: dict[object, int] = {}
_ONE_BITS = struct.unpack("<q", struct.pack("<d", 1.0))[0]


def code(text: str) -> int:
    """A name as a number that is the same in every process (and can be shown again)."""
    found = _codes.get(text)
    if found is None:
        found = _codes[text] = zlib.crc32(text.encode())
        _names[found] = text
    return found


def _learn_names() -> None:
    """Every dtype and the usual device types, so a rank can name what the others sent."""
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            code(str(value).removeprefix("torch."))
    for device_type in ("cpu", "cuda", "mps", "xpu", "hpu", "meta"):
        code(device_type)


_learn_names()


def _known_code(value) -> int:
    """The code of a dtype, a device type or an op (whose enum's other names are learnt)."""
    found = _known.get(value)
    if found is None:
        if isinstance(value, enum.Enum):
            for member in type(value):  # so that every rank can name the ops the others used
                code(member.name)
            found = code(value.name)
        else:
            found = code(str(value).removeprefix("torch."))
        _known[value] = found
    return found


def _float_bits(x: float) -> int:
    """A float as the int64 with its bits, so that it travels in a header exactly."""
    return _ONE_BITS if x == 1.0 else struct.unpack("<q", struct.pack("<d", float(x)))[0]


def from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def header(kind: str, dtype: torch.dtype | None = None, device: torch.device | None = None,
           shape: Sequence[int] | None = None, op: enum.Enum | str | None = None,
           root: int = -1, prescale: float = 1.0, postscale: float = 1.0, extra: int = 0,
           carried: int = 0, deferrable: bool = False) -> list[int]:
    """The words that describe one call; ``carried`` and ``deferrable`` travel along and are
    not compared."""
    words = [0] * HEADER_WORDS
    words[KIND] = KINDS.index(kind) + 1
    words[DTYPE] = _known_code(dtype) if dtype is not None else 0
    words[DEVICE] = _known_code(torch.device(device).type) if device is not None else 0
    dims = [int(n) for n in shape] if shape is not None else []
    words[NDIM] = len(dims) if shape is not None else -1
    words[DIMS] = (dims + [-1] * MAX_DIMS)[:MAX_DIMS]
    words[MORE_DIMS] = zlib.crc32(repr(dims[MAX_DIMS:]).encode()) if len(dims) > MAX_DIMS else 0
    words[OP] = _known_code(op) if op is not None else 0
    words[ROOT] = int(root)
    words[PRESCALE] = _float_bits(prescale)
    words[POSTSCALE] = _float_bits(postscale)
    words[EXTRA] = int(extra)
    words[CARRIED] = int(carried)
    words[FLAGS] = DEFERRABLE if deferrable else 0
    return words


def barrier_lets_pass(headers: Sequence[Sequence[int]]) -> bool:
    """Whether ranks in a barrier met operations other ranks started ``*_async`` (and nothing
    else): Horovod matches operations by name, so a barrier does not wait for operations in
    flight, and a rank may start one, then wait in the barrier, while another rank starts it
    only after the barrier. Every rank sees the same headers: those in the barrier exchange
    again, those starting an operation put it off (``call_check.Deferred``)."""
    kinds = [h[KIND] for h in headers]
    return BARRIER in kinds and any(k != BARRIER for k in kinds) and all(
        k == BARRIER or h[FLAGS] & DEFERRABLE for k, h in zip(kinds, headers))


def plan_hash(parts: Sequence) -> int:
    """A CRC-32 of ``parts`` (numbers and strings), for the extra word."""
    return zlib.crc32(repr(list(parts)).encode())


def disagreement(headers: Sequence[Sequence[int]]) -> str | None:
    """What the ranks disagree on, as the message every rank raises; None when they agree.

    ``headers``: every rank's header, in rank order. A pure function of them, so every rank
    reaches the same verdict. Ranks waiting in ``hvd.join()`` send a "join" header: the others
    agree without them on a call those ranks can serve (:data:`SERVED_BY_JOINED`), and on
    nothing else.
    """
    if all(h[:CARRIED] == headers[0][:CARRIED] for h in headers):
        return None
    joined = [r for r, h in enumerate(headers) if h[KIND] == JOIN]
    if len(joined) == len(headers):
        return None  # every rank has joined: join() returns
    active = [None if h[KIND] == JOIN else h for h in headers]
    kinds = [None if h is None else h[KIND] for h in active]
    if len(set(kinds) - {None}) > 1:
        return (f"ranks called different collectives: "
                f"{_by_rank(kinds, _kind_name, verb=False)}. {ADVICE}")
    kind = _kind_name(next(k for k in kinds if k is not None))
    if joined and (kind not in SERVED_BY_JOINED or any(
            h is not None and (h[NDIM] > MAX_DIMS or _names.get(h[OP]) == "Adasum")
            for h in active)):
        return (f"{kind} while {describe_ranks(joined)} {'has' if len(joined) == 1 else 'have'} "
                f"joined: a rank waiting in hvd.join() takes part only in allreduce (of at most "
                f"{MAX_DIMS} dimensions, not Adasum), DistributedOptimizer steps and barrier. Call "
                f"hvd.join() on every rank before other collectives.")
    fields = [
        ("dtypes", lambda h: h[DTYPE], _name),
        ("devices", lambda h: h[DEVICE], _name),
        (_SHAPE_LABELS.get(kind, "tensor shapes"),
         lambda h: (h[NDIM], *h[DIMS], h[MORE_DIMS]), lambda s: _shape_text(s, kind)),
        ("reduce ops", lambda h: h[OP], _name),
        ("root ranks", lambda h: h[ROOT], str),
        ("prescale factors", lambda h: h[PRESCALE], lambda b: f"{from_bits(b):g}"),
        ("postscale factors", lambda h: h[POSTSCALE], lambda b: f"{from_bits(b):g}"),
    ]
    problems = []
    for label, field, show in fields:
        values = [None if h is None else field(h) for h in active]
        if len(set(values) - {None}) > 1:
            problems.append(f"{label} differ between ranks: {_by_rank(values, show)}")
    extras = [None if h is None else h[EXTRA] for h in active]
    if not problems and len(set(extras) - {None}) > 1:  # a hash: adds nothing to the above
        letters = {v: chr(ord("A") + i) for i, (_, v) in enumerate(_groups(extras))}
        problems.append(f"{_EXTRA_LABELS.get(kind, 'arguments')} differ between ranks: "
                        f"{_by_rank(extras, lambda v: 'plan ' + letters[v])}")
    if not problems:
        return None
    return f"{kind}: {'; '.join(problems)}. {ADVICE}"


def _kind_name(number: int) -> str:
    return KINDS[number - 1] if 0 < number <= len(KINDS) else f"an unknown call ({number})"


def name_of(number: int) -> str:
    """The text a code stands for (a dtype, a device type or an op, as :func:`code` made it)."""
    return _names[number]


def _name(number: int) -> str:
    return _names.get(number, f"#{number}") if number else "none"


def _shape_text(shape: tuple, kind: str) -> str:
    ndim, dims = shape[0], list(shape[1:1 + MAX_DIMS])
    if ndim < 0:
        return "none"
    text = [str(n) for n in dims[:min(ndim, MAX_DIMS)]] + (["..."] if ndim > MAX_DIMS else [])
    if kind == "allgather":
        return "(" + ", ".join(["*", *text]) + ")"
    return "(" + ", ".join(text) + ("," if len(text) == 1 else "") + ")"


def _groups(values: list) -> list[tuple[list[int], object]]:
    """(ranks, value) for each distinct value, in order of its first rank."""
    found: dict = {}
    for r, v in enumerate(values):
        if v is not None:  # None: a rank that has joined
            found.setdefault(v, []).append(r)
    return [(ranks, v) for v, ranks in found.items()]


def _by_rank(values: list, show, verb: bool = True) -> str:
    parts = []
    for ranks, v in _groups(values):
        has = (" has " if len(ranks) == 1 else " have ") if verb else " "
        parts.append(f"{describe_ranks(ranks)}{has}{show(v)}")
    return ", ".join(parts)
