"""``DistributedOptimizer``: any torch optimizer, with gradients averaged over ranks.

Algorithm (data-parallel SGD, as in Horovod, Sergeev & Del Balso 2018, and PyTorch DDP, Li et
al. 2020): parameters are packed into fused buckets, in reverse order of registration (roughly
the order backward produces their gradients). When every gradient of a bucket has been
accumulated, a hook starts an asynchronous allreduce of the whole bucket, so communication
overlaps the rest of backward; ``step()`` waits for what is still in flight, writes the averaged
gradients back, and runs the wrapped optimizer. Buckets are always launched in index order, so
every rank issues the same collectives in the same order. A model whose gradients fit in one
bucket gets no hooks at all: its single allreduce runs in ``step()``.

Each bucket carries one extra number per parameter, "this rank had a gradient", summed with the
gradients. A parameter that got no gradient on some ranks therefore never blocks the others
(its bucket is sent with zeros by ``step()``), and one that got no gradient anywhere keeps
``grad = None``, as it would in a single process.

Before the first bucket of each step leaves, the ranks check that they all send the same
buckets (:mod:`ipydist.torch.agreement`): a rank with a different model raises, with the
others, instead of aborting on gloo's "message sizes differ". One check per step, not per
bucket: a blocking check before each bucket would cost the overlap with backward. Over MPI the
check is sent at ``zero_grad()`` and only collected when the first bucket leaves, by when it
has finished: waiting for it there made short steps 10 % slower. What that cannot catch: a
rank that makes an extra ipydist collective between ``zero_grad()`` and ``step()`` meets the
others' gradients in a stall (a stall warning names both calls), not in a mismatch error.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ipydist.rank.sampler import waits_for_peers
from ipydist.torch import agreement, consistency, runtime, transport, waiting
from ipydist.torch.collectives import Average, ReduceOp, Sum, _rt, size
from ipydist.torch.compression import Compression, Compressor

#: Default bucket size, DDP's; benchmarks/train_step.py sweeps it (see the README).
DEFAULT_BUCKET_CAP_MB = 25.0
#: Cap of the first bucket (DDP's too): small, so communication starts early in backward.
FIRST_BUCKET_MB = 1.0
#: A parameter at least this large is a bucket of its own, which MPI reduces in the gradient's
#: own memory: packing it into a bucket and unpacking it again cost two passes over it, a
#: third of DistributedOptimizer's overhead on benchmarks/train_step.py's large model.
OWN_BUCKET_BYTES = 1 << 20

#: Attribute on each parameter holding the hook of the DistributedOptimizer that owns it. A
#: notebook re-runs cells, so a second DistributedOptimizer over the same model must take the
#: hooks over, or the first one's hooks would start collectives nobody waits for.
_HOOK_ATTR = "_ipydist_grad_hook"


@dataclass
class _Bucket:
    """Parameters sent together, and the buffer they travel in (kept between steps: a fresh
    allocation of many megabytes each step costs more than the copy into it)."""

    params: list[torch.nn.Parameter]
    numel: int
    ready: set[int] = field(default_factory=set)
    work: object = None  # the allreduce in flight: a torch Work, or an MPI chain (``mpi``)
    mpi: bool = False
    #: One large parameter (OWN_BUCKET_BYTES): over MPI, uncompressed, its gradient travels in
    #: place (``sent``), followed by its had-gradient flag (``flag``).
    own: bool = False
    sent: torch.Tensor | None = None
    flag: torch.Tensor | None = None
    wire: torch.Tensor | None = None
    ctx: object = None
    buffer: torch.Tensor | None = None  # gradients, then one had-gradient flag per parameter
    views: list[torch.Tensor] = field(default_factory=list)

    def allocate(self) -> None:
        first = self.params[0]
        self.buffer = torch.empty(
            self.numel + len(self.params), dtype=first.dtype, device=first.device
        )
        grads = self.buffer[:self.numel].split([p.numel() for p in self.params])
        self.views = [v.view_as(p) for v, p in zip(grads, self.params)]


class _DistributedMixin:
    """Methods mixed into a subclass of the wrapped optimizer's own class."""

    def _ipydist_setup(
        self, named_parameters, compression, backward_passes_per_step, op,
        gradient_predivide_factor, bucket_cap_mb,
    ) -> None:
        if op not in (Average, Sum):
            raise ValueError(f"DistributedOptimizer op must be Average or Sum, not {op}")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be at least 1")
        if not (isinstance(compression, type) and issubclass(compression, Compressor)):
            raise TypeError("compression must be Compression.none, .fp16 or .bf16")
        params = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad
        ]
        consistency.track_optimizer(self)  # kept in step after an interrupt
        self._names = _names_for(params, named_parameters)
        self._compression = compression
        self._passes = backward_passes_per_step
        self._op = op
        # Average divides by the world size before the sum (fewer overflows in 16 bits), or
        # with gradient_predivide_factor f, by f before and by size/f after, as Horovod does.
        f = float(gradient_predivide_factor)
        self._prescale = 1.0 if op is Sum else (1.0 / f if f != 1.0 else 1.0 / size())
        self._postscale = f / size() if op is Average and f != 1.0 else 1.0
        self._buckets = _plan_buckets(params, bucket_cap_mb * 2**20)
        self._slot = {id(p): (b, i) for b, bucket in enumerate(self._buckets)
                      for i, p in enumerate(bucket.params)}
        self._passes_left = {id(p): self._passes for p in params}
        self._next_launch = 0
        self._step_agreed = False  # this step's buckets were checked against the other ranks'
        self._announced: agreement.Announced | None = None  # this step's check, sent ahead
        self._header: np.ndarray | None = None  # what it sends (built on first use)
        self._plan = agreement.plan_hash(
            [(b.numel, str(b.params[0].dtype), b.params[0].device.type) for b in self._buckets]
            + [compression.__name__])
        self._grad_marks: list | None = None  # gradients as the last synchronize() left them
        self._skip_sync = False
        hook = self._make_hook() if len(self._buckets) > 1 else None
        for p in params:
            old = getattr(p, _HOOK_ATTR, None)
            if old is not None:
                old.remove()
            setattr(p, _HOOK_ATTR, hook and p.register_post_accumulate_grad_hook(hook))

    def _make_hook(self):
        me = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = me()
            if opt is not None:
                opt._gradient_ready(p)

        return hook

    # --- during backward ----------------------------------------------------------------------

    def _gradient_ready(self, p: torch.Tensor) -> None:
        key = id(p)
        self._passes_left[key] -= 1
        if self._passes_left[key] > 0:
            return
        b, i = self._slot[key]
        bucket = self._buckets[b]
        if i in bucket.ready or bucket.work is not None:
            raise RuntimeError(
                f"the gradient of {self._names[key]} was computed again before step(): call "
                "optimizer.step() (or synchronize()) after each backward, or pass "
                "backward_passes_per_step=k to accumulate k backward passes."
            )
        bucket.ready.add(i)
        while (
            self._next_launch < len(self._buckets)
            and len(self._buckets[self._next_launch].ready)
            == len(self._buckets[self._next_launch].params)
        ):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        self._progress()

    def _progress(self) -> None:
        """Move the MPI allreduces in flight on: MPI moves them only inside its calls, and
        each gradient hook is a chance to make one while backward goes on."""
        for bucket in self._buckets[:self._next_launch]:
            if bucket.mpi and not transport.progress(bucket.work):
                return  # later ones wait behind it

    def _launch(self, bucket: _Bucket) -> None:
        """Pack the bucket (gradients, then one had-gradient flag per parameter) and send it."""
        if not self._step_agreed:
            self._agree_on_step()
        if self._in_place(bucket):
            self._launch_in_place(bucket)
            return
        if bucket.buffer is None:
            bucket.allocate()
        flat = bucket.buffer
        grads = [p.grad for p in bucket.params]
        if len(grads) > 8 and bucket.numel < 65536 * len(grads):
            # many small tensors: one cat and one scale beat a dispatch per tensor
            torch.cat(
                [g.reshape(-1) if g is not None else v.new_zeros(v.numel())
                 for g, v in zip(grads, bucket.views)],
                out=flat[:bucket.numel],
            )
            if self._prescale != 1.0:
                flat[:bucket.numel].mul_(self._prescale)
        else:
            # few large tensors: copy and scale in one pass each, as DDP does
            for g, view in zip(grads, bucket.views):
                if g is None:
                    view.zero_()
                elif self._prescale != 1.0:
                    torch.mul(g, self._prescale, out=view)
                else:
                    view.copy_(g)
        flat[bucket.numel:].copy_(torch.tensor([g is not None for g in grads]))
        bucket.wire, bucket.ctx = self._compression.compress(flat)
        bucket.mpi = transport.uses_mpi(bucket.wire)
        if bucket.mpi:
            bucket.work = transport.start_allreduce(bucket.wire)
        else:
            bucket.work = dist.all_reduce(bucket.wire, op=dist.ReduceOp.SUM, async_op=True)

    def _in_place(self, bucket: _Bucket) -> bool:
        """Whether the bucket's one gradient travels in its own memory (the same answer on
        every rank: the agreement check made the plan, dtype, device and compression equal)."""
        return (bucket.own and self._compression is Compression.none
                and transport.uses_mpi(bucket.params[0]))

    def _launch_in_place(self, bucket: _Bucket) -> None:
        p = bucket.params[0]
        grad = p.grad
        bucket.sent = torch.zeros_like(p) if grad is None else (
            grad if grad.is_contiguous() else grad.contiguous())
        bucket.flag = torch.tensor([float(grad is not None)], dtype=p.dtype)
        bucket.mpi = True
        bucket.work = transport.start_allreduce(bucket.sent, also=[bucket.flag])

    @waits_for_peers("allreduce of gradients (DistributedOptimizer)")
    def _agree_on_step(self) -> None:
        """Check that every rank sends the same buckets this step. A mismatch leaves nothing
        in flight, so the optimizer works again once the ranks agree."""
        announced, self._announced = self._announced, None
        try:
            if agreement.usable(announced):
                agreement.settle(upto=announced)  # raises on a mismatch
            else:  # none sent (zero_grad not called), or the recovery dropped it
                agreement.agree("optimizer step", **self._signature())
        except BaseException:
            self._abandon_pending()
            raise
        self._step_agreed = True

    def _signature(self) -> dict:
        """What the other ranks' steps must match: bucket sizes, dtype, device, op, scaling."""
        first = self._buckets[0].params[0]  # only called when there are buckets
        return dict(dtype=first.dtype, device=first.device,
                    shape=[b.numel for b in self._buckets], op=self._op,
                    prescale=self._prescale, postscale=self._postscale, extra=self._plan)

    # --- at step ------------------------------------------------------------------------------

    @waits_for_peers("allreduce of gradients (DistributedOptimizer)")
    def synchronize(self) -> None:
        """Finish averaging every gradient over the ranks (collective: every rank calls it).

        A second call with no backward in between does nothing, so ``synchronize()`` followed
        by ``step()`` averages once.
        """
        if self._grad_marks == self._current_marks():
            return
        _rt()
        while self._next_launch < len(self._buckets):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1
        for bucket in self._buckets:
            t0 = time.perf_counter()
            if bucket.mpi:
                transport.finish(bucket.work)
            else:
                waiting.wait_for(bucket.work)
            runtime.note_wait(time.perf_counter() - t0)  # for the live view's straggler strip
            if bucket.sent is not None:
                self._unpack_in_place(bucket)
                continue
            flat = self._compression.decompress(bucket.wire, bucket.ctx)
            had_grad = flat[bucket.numel:].tolist()
            views = bucket.views if flat is bucket.buffer else [
                v.view_as(p) for v, p in zip(
                    flat[:bucket.numel].split([p.numel() for p in bucket.params]),
                    bucket.params)
            ]
            grads, sources = [], []
            for p, view, had in zip(bucket.params, views, had_grad):
                if had > 0:
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        grads.append(p.grad)
                        sources.append(view)
            if grads:
                torch._foreach_copy_(grads, sources)  # one dispatch for the whole bucket
            if self._postscale != 1.0:
                torch._foreach_mul_(
                    [p.grad for p, had in zip(bucket.params, had_grad) if had > 0],
                    self._postscale,
                )
            bucket.work = bucket.wire = bucket.ctx = None
            bucket.ready.clear()
        self._next_launch = 0
        self._step_agreed = False
        self._passes_left = dict.fromkeys(self._passes_left, self._passes)
        self._grad_marks = self._current_marks()

    def _unpack_in_place(self, bucket: _Bucket) -> None:
        p, sent = bucket.params[0], bucket.sent
        if bucket.flag.item() > 0:  # some rank had a gradient
            if p.grad is None:
                p.grad = sent
            elif sent is not p.grad:
                p.grad.copy_(sent)
            scale = self._prescale * self._postscale
            if scale != 1.0:
                p.grad.mul_(scale)
        bucket.work = bucket.sent = bucket.flag = None
        bucket.ready.clear()

    def _abandon_pending(self) -> None:
        """Forget a gradient averaging that a failed or interrupted cell left half done (its
        collectives are void: the group is rebuilt where they broke it), so the next cell can
        call ``zero_grad()`` and train on."""
        for bucket in self._buckets:
            bucket.work = bucket.wire = bucket.ctx = bucket.sent = bucket.flag = None
            bucket.ready.clear()
        self._next_launch = 0
        self._step_agreed = False
        self._announced = None  # the recovery replaces the communicator it was sent on
        self._passes_left = dict.fromkeys(self._passes_left, self._passes)
        self._grad_marks = None

    def _current_marks(self) -> list:
        """Identity and version of every gradient: they change whenever backward writes one."""
        return [
            None if p.grad is None else (id(p.grad), p.grad._version)
            for bucket in self._buckets for p in bucket.params
        ]

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not synchronize (you called synchronize())."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        if not self._skip_sync:
            self.synchronize()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(b.work is not None for b in self._buckets):
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); call zero_grad() before backward."
            )
        super().zero_grad(set_to_none=set_to_none)
        if self._announced is None and self._buckets and not self._step_agreed:
            if self._header is None:
                self._header = np.asarray(
                    agreement.header("optimizer step", **self._signature()), dtype=np.int64)
            self._announced = agreement.announce(self._header)


def _names_for(params, named_parameters) -> dict[int, str]:
    if named_parameters is None:
        return {id(p): f"parameter {i}" for i, p in enumerate(params)}
    pairs = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in pairs):
        raise ValueError("named_parameters should be model.named_parameters(): (name, param) pairs")
    names = [n for n, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {', '.join(duplicates)}")
    by_id = {id(p): n for n, p in pairs}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(
            f"{len(unnamed)} of the optimizer's parameters are not in named_parameters; "
            "pass the named_parameters() of the model the optimizer was built on."
        )
    return {id(p): by_id[id(p)] for p in params}


def _plan_buckets(params, cap_bytes: float) -> list[_Bucket]:
    """Fused buckets of one dtype and device, in reverse order of the parameters.

    As in DDP, a bucket closes once it holds at least its cap, and the first bucket's cap is
    small (FIRST_BUCKET_MB), so that the first allreduce starts early in backward and overlaps
    the rest of it. A parameter of OWN_BUCKET_BYTES or more is a bucket of its own.
    """
    buckets: list[_Bucket] = []
    open_by_kind: dict[tuple, tuple[_Bucket, float]] = {}
    for p in reversed(params):
        if p.numel() * p.element_size() >= OWN_BUCKET_BYTES:
            buckets.append(_Bucket([p], p.numel(), own=True))
            continue
        kind = (p.dtype, p.device)
        if kind not in open_by_kind:
            limit = min(cap_bytes, FIRST_BUCKET_MB * 2**20) if not buckets else cap_bytes
            open_by_kind[kind] = (_Bucket([], 0), limit)
            buckets.append(open_by_kind[kind][0])
        bucket, limit = open_by_kind[kind]
        bucket.params.append(p)
        bucket.numel += p.numel()
        if bucket.numel * p.element_size() >= limit:
            del open_by_kind[kind]
    return buckets


def DistributedOptimizer(  # noqa: N802 - Horovod's name, a factory like Horovod's
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of the optimizer's own class (LR schedulers accept it) sharing the
    original's state. ``backward_passes_per_step=k`` sums k local backward passes before one
    allreduce (scale the loss by 1/k for the mean, as with any gradient accumulation).
    Call ``synchronize()`` then step inside ``skip_synchronize()`` to clip averaged gradients.
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedMixin, base), {"__module__": base.__module__})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = optimizer.__dict__  # the same state, param_groups and hooks
    if "step" in wrapped.__dict__:  # an LR scheduler patched the instance's step
        warnings.warn(
            "wrap the optimizer in DistributedOptimizer before creating its LR scheduler",
            stacklevel=2,
        )
    wrapped._ipydist_setup(
        named_parameters, compression, backward_passes_per_step, op,
        gradient_predivide_factor, bucket_cap_mb,
    )
    return wrapped
