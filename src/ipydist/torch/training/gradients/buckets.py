"""DistributedOptimizer's gradient buckets: how they are planned, packed, sent and unpacked.

A bucket is a set of parameters whose gradients travel in one allreduce. Packed buckets copy
their gradients (scaled, for Average) into one buffer followed by one "this rank had a
gradient" flag per parameter, summed with the gradients, so that a parameter without a gradient
on some ranks is averaged with zeros there and one without a gradient anywhere keeps ``None``.
Over MPI and uncompressed, a parameter of OWN_BUCKET_BYTES or more is a bucket of its own: its
gradient is reduced where it lies, followed by its flag, with no pack and no unpack. The wire
is MPI or the process group (:mod:`ipydist.torch._wire.transport`); the optimizer decides when.

Nothing is written into a gradient until every bucket of the step has finished and the group is
known usable (:func:`unpack`): an NCCL abort (a release) ends its kernels early without an
error, so what a released rank received may be half reduced. On a GPU the step reads from the
device once, and nothing else waits for it: flags are written where they lie, and only those
of parameters this rank had no gradient for are read (one it had, some rank had).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ipydist.torch._core import topology, waiting
from ipydist.torch._wire import transport
from ipydist.torch._wire.compression import AnyCompressor, sends_as_is
from ipydist.torch.training.gradients.exchanges import (
    Exchange,
    InPlace,
    KeptExchange,
    Packed,
    dense,
    kept_exchange,
)
from ipydist.torch.training.gradients.momentum_correction import MomentumCorrection

#: Cap of the first bucket (DDP's too): small, so communication starts early in backward.
FIRST_BUCKET_MB = 1.0
#: A parameter at least this large is a bucket of its own where MPI reduces it in the
#: gradient's own memory: packing it into a bucket and unpacking it again cost two passes over
#: it, a third of DistributedOptimizer's overhead on benchmarks/train_step.py's large model.
#: Anywhere else (NCCL, gloo, compressed) it is fused like any other (see :func:`alone_rule`).
OWN_BUCKET_BYTES = 1 << 20


@dataclass
class Bucket:
    """Parameters sent together, and the buffer they travel in (kept between steps: a fresh
    allocation of many megabytes each step costs more than the copy into it)."""

    params: list[torch.nn.Parameter]
    numel: int
    ready: set[int] = field(default_factory=set)
    #: This step's exchange, in flight (None between steps): how the gradients travel, with
    #: its own state (:mod:`ipydist.torch.training.gradients.exchanges`).
    exchange: Exchange | None = None
    #: One large parameter (OWN_BUCKET_BYTES): over MPI, uncompressed, its gradient travels in
    #: place (:class:`~ipydist.torch.training.gradients.exchanges.InPlace`).
    own: bool = False
    buffer: torch.Tensor | None = None  # gradients, then one had-gradient flag per parameter
    views: list[torch.Tensor] = field(default_factory=list)
    #: A compression's own exchange (``Compressor.exchange``), with the state it keeps
    #: between steps (error feedback): made on its first step.
    kept: KeptExchange | None = None
    #: A compression that keeps SGD's momentum on each rank (``Compressor.keeps_momentum``):
    #: that momentum, before the exchange (the optimizer sets it).
    correction: MomentumCorrection | None = None
    #: Its place in the optimizer's plan (the same on every rank).
    index: int = 0
    #: What this rank sent in the last launch (transport.bytes_sent's model).
    sent_bytes: int = 0
    #: When the last launch began (``time.perf_counter()``), for the timeline.
    launched: float = 0.0

    def allocate(self) -> None:
        first = self.params[0]
        self.buffer = torch.empty(
            self.numel + len(self.params), dtype=first.dtype, device=first.device
        )
        grads = self.buffer[:self.numel].split([p.numel() for p in self.params])
        self.views = [v.view_as(p) for v, p in zip(grads, self.params)]

    # --- sending ------------------------------------------------------------------------------

    def launch(self, compression: AnyCompressor, prescale: float, group=None,
               step: int = 0) -> None:
        """Start this bucket's exchange (the caller has checked the step with the others)
        among every rank, or a process set's (``group``: its communicators): the way is chosen
        here, once a step, and the exchange keeps what it needs. ``step``: the optimizer's
        steps so far."""
        self.launched = time.perf_counter()
        exchange: Exchange
        if self.travels_in_place(compression, group):
            exchange = InPlace(self.params[0], group)
        else:
            flat, had = self._pack(prescale)
            if compression.exchange is not None:  # the compression's own, kept
                kept = self.kept_exchange(compression)
                kept.start(flat, step)
                exchange = kept
            else:
                exchange = Packed(flat, self.numel, self.views, had, compression, group)
        self.exchange = exchange
        self.sent_bytes = exchange.sent_bytes

    def _pack(self, prescale: float) -> tuple[torch.Tensor, list[bool]]:
        """The gradients (scaled) copied into the bucket's buffer, then this rank's
        had-gradient flags; and those flags."""
        if self.buffer is None:
            self.allocate()
        flat = self.buffer
        assert flat is not None  # allocate made it
        grads = [dense(p.grad) for p in self.params]
        had = [g is not None for g in grads]
        if len(grads) > 8 and self.numel < 65536 * len(grads):
            # many small tensors: one cat and one scale beat a dispatch per tensor
            torch.cat(
                [g.reshape(-1) if g is not None else v.new_zeros(v.numel())
                 for g, v in zip(grads, self.views)],
                out=flat[:self.numel],
            )
            if prescale != 1.0:
                flat[:self.numel].mul_(prescale)
        else:
            # few large tensors: copy and scale in one pass each, as DDP does
            for g, view in zip(grads, self.views):
                if g is None:
                    view.zero_()
                elif prescale != 1.0:
                    torch.mul(g, prescale, out=view)
                else:
                    view.copy_(g)
        _mark(flat[self.numel:], had)
        return flat, had

    def travels_in_place(self, compression: AnyCompressor, group=None) -> bool:
        """Whether the bucket's one gradient travels in its own memory (the same answer on
        every rank: the call check made the plan, dtype, device and compression equal)."""
        return (self.own and sends_as_is(compression)
                and transport.uses_mpi(self.params[0], group))

    def kept_exchange(self, compression: AnyCompressor) -> KeptExchange:
        """The bucket's exchange for ``compression``, made with fresh state on first use."""
        if self.kept is None:
            rt = topology.get()
            assert rt is not None  # a step runs on a rank
            made = kept_exchange(compression)
            assert made is not None  # the compression names one
            self.kept = made.for_bucket(self, compression, rt.size, rt.rank)
        return self.kept

    def progress(self) -> bool:
        """Let the exchange move on (MPI moves it only inside its calls); True once done
        (a gloo one moves by itself: True)."""
        assert self.exchange is not None  # launched
        return self.exchange.progress()

    # --- receiving ----------------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for the exchange (a release ends the wait). On a GPU the wait only orders the
        device's stream after it: :func:`unpack` is where the host waits for the device."""
        assert self.exchange is not None  # launched
        self.exchange.finish()

    def receive(self) -> list[torch.Tensor]:
        """Take the finished exchange's result for :meth:`write`, decompressed where it lies
        (on a GPU only queued: nothing is read here), and return the summed had-gradient
        flags this rank must read: those of the parameters it had no gradient for (where it
        had one, some rank had)."""
        assert self.exchange is not None  # finished
        return self.exchange.to_read()

    def write(self, flags: list, prescale: float, postscale: float,
              sparse_as_dense: bool = False) -> None:
        """Write the averaged gradients into the parameters' ``grad`` where some rank had one
        (``flags``: the values of what :meth:`receive` asked to read, in its order); a sparse
        one (it was sent dense) comes back sparse, as Horovod hands it back. Only once the
        group is known usable (:func:`unpack`)."""
        assert self.exchange is not None  # received
        self.exchange.write(self, flags, prescale, postscale, sparse_as_dense)
        self.abandon()

    def write_gradients(self, values, had_grad: list[bool], postscale: float) -> None:
        """Each parameter's averaged gradient from ``values`` (one flat piece per parameter),
        where some rank had a gradient (what the packed and the kept exchanges write)."""
        grads, sources, sparse = [], [], []
        for p, value, had in zip(self.params, values, had_grad):
            if had:
                if p.grad is None or p.grad.is_sparse:
                    if p.grad is not None:
                        sparse.append(p)
                    p.grad = value.view_as(p).to(p.dtype, copy=True)
                else:
                    grads.append(p.grad)
                    sources.append(value.view_as(p))
        if grads:
            torch._foreach_copy_(grads, sources)  # one dispatch for the whole bucket
        if postscale != 1.0:
            torch._foreach_mul_(
                [p.grad for p, had in zip(self.params, had_grad) if had], postscale)
        for p in sparse:  # back to the layout it came in: its rows
            p.grad = p.grad.to_sparse(1)

    def abandon(self) -> None:
        """Forget what is in flight (done, or void after a release) and the gradients seen."""
        if self.kept is not None:
            self.kept.abandon()
        self.exchange = None
        self.ready.clear()


def unpack(buckets: list[Bucket], prescale: float, postscale: float,
           sparse_as_dense: bool = False) -> None:
    """Write the averaged gradients of every finished bucket, once the group is known usable.

    The flags this rank must read are read at once, one read per device; on a GPU that read
    (an empty one when nothing is to be read there) is where the host waits for the step's
    allreduces. Then the group is checked, before anything is written: NCCL's abort ends its
    kernels early without an error, so a released rank would otherwise write, and step with,
    gradients half reduced, and the resync would spread rank 0's. A release after the check
    finds the step's data complete.
    """
    wanted = [bucket.receive() for bucket in buckets]
    read = _read([f for flags in wanted for f in flags],
                 {bucket.params[0].device for bucket in buckets})
    waiting.check_usable()  # after the last read, before the first write
    start = 0
    for bucket, flags in zip(buckets, wanted):
        bucket.write(read[start:start + len(flags)], prescale, postscale, sparse_as_dense)
        start += len(flags)


def _read(flags: list[torch.Tensor], devices) -> list:
    """The values of ``flags`` (0-d, each on one of ``devices``), in order: one read per
    device, and on each device other than the CPU a wait even with nothing to read there (see
    :func:`unpack`; a CPU bucket's wait was the host's own)."""
    values: dict[int, float] = {}
    for device in devices:
        mine = [i for i, f in enumerate(flags) if f.device == device]
        if not mine and device.type == "cpu":
            continue
        stacked = (torch.stack([flags[i] for i in mine]) if mine
                   else torch.empty(0, device=device))
        values.update(zip(mine, waiting.read_from_device(stacked)))
    return [values[i] for i in range(len(flags))]


def _mark(flags: torch.Tensor, had: list[bool]) -> None:
    """Write this rank's had-gradient flags where they lie: ones, then zeros over each run of
    parameters without a gradient. On a GPU a copy from a host tensor would wait for the
    device, in the gradient hook, at every bucket's launch."""
    flags.fill_(1)
    start = None
    for i, h in enumerate([*had, True]):
        if not h and start is None:
            start = i
        elif h and start is not None:
            flags[start:i].zero_()
            start = None


def alone_rule(compression: AnyCompressor, distributed_after: int = 0, group=None):
    """Which parameters :func:`plan` gives a bucket of their own (a predicate; None: none):
    those of OWN_BUCKET_BYTES or more whose bucket may travel in place, over MPI, on the CPU,
    uncompressed (always, or in a warm start: ``distributed_after``). Anywhere else (NCCL,
    gloo, compressed) a bucket of its own saves no copy and costs an allreduce and a wait of
    its own: a BERT-large-sized model had about 150 buckets where DDP has a tenth. Decided
    from what every rank has alike (the transport, dtype, device, compression), so every rank
    plans alike; the step's check compares the plans anyway."""
    if not sends_as_is(compression) and not distributed_after:
        return None
    return lambda p: (p.numel() * p.element_size() >= OWN_BUCKET_BYTES
                      and transport.uses_mpi(p, group))


def plan(params, cap_bytes: float, groups=(), alone=None) -> list[Bucket]:
    """Fused buckets of one dtype and device, in reverse order of the parameters.

    As in DDP, a bucket closes once it holds at least its cap, and the first bucket's cap is
    small (FIRST_BUCKET_MB), so that the first allreduce starts early in backward and overlaps
    the rest of it. A parameter for which ``alone`` (see :func:`alone_rule`) says so is a
    bucket of its own. Each of ``groups`` (Horovod's explicit groups: lists of parameters) is
    fused apart from the rest, one bucket per dtype and device, where its last parameter would
    open one.
    """
    group_of = {id(p): i for i, g in enumerate(groups) for p in g}
    buckets: list[Bucket] = []
    open_by_kind: dict[tuple, tuple[Bucket, float]] = {}
    for p in reversed(params):
        explicit = group_of.get(id(p))
        if explicit is None and alone is not None and alone(p):
            buckets.append(Bucket([p], p.numel(), own=True))
            continue
        kind = (p.dtype, p.device, explicit)
        if kind not in open_by_kind:
            limit = min(cap_bytes, FIRST_BUCKET_MB * 2**20) if not buckets else cap_bytes
            open_by_kind[kind] = (Bucket([], 0), float("inf") if explicit is not None
                                  else limit)
            buckets.append(open_by_kind[kind][0])
        bucket, limit = open_by_kind[kind]
        bucket.params.append(p)
        bucket.numel += p.numel()
        if bucket.numel * p.element_size() >= limit:
            del open_by_kind[kind]
    for index, bucket in enumerate(buckets):
        bucket.index = index
    return buckets
