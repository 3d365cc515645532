"""``DistributedOptimizer``: any torch optimizer, with gradients averaged over ranks.

Algorithm (data-parallel SGD, as in Horovod, Sergeev & Del Balso 2018, and PyTorch DDP, Li et al.
2020): parameters are packed into fused buckets, in reverse order of registration (roughly the
order backward produces their gradients). When every gradient of a bucket has been accumulated, a
hook starts an asynchronous allreduce of the whole bucket, so communication overlaps the rest of
backward; ``step()`` waits for what is still in flight, writes the averaged gradients back, and
runs the wrapped optimizer. Buckets are always launched in index order, so every rank issues the
same collectives in the same order. A model whose gradients fit in one bucket gets no hooks at
all: its single allreduce runs in ``step()``. How a bucket is packed, sent (over MPI or the
process group) and unpacked is :mod:`ipydist.torch.training.gradients.buckets`; a parameter that
got no gradient on some ranks never blocks the others (its bucket is sent with zeros by
``step()``), and one that got no gradient anywhere keeps ``grad = None``, as in one process.

Before the first bucket of each step leaves, the ranks check that they all send the same
buckets (:mod:`ipydist.torch._wire.call_check`): a rank with a different model raises, with the
others, instead of aborting on gloo's "message sizes differ". One check per step, not per
bucket: a blocking check before each bucket would cost the overlap with backward. Over MPI the
check is sent at ``zero_grad()`` and only collected when the first bucket leaves, by when it
has finished: waiting for it there made short steps 10 % slower. What that cannot catch: a
rank that makes an extra ipydist collective between ``zero_grad()`` and ``step()`` meets the
others' gradients in a stall (a stall warning names both calls), not in a mismatch error.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
import weakref

import numpy as np
import torch

from ipydist.torch._core import events, process_group, resync, waiting
from ipydist.torch._core.marks import waits_for_peers
from ipydist.torch._wire import call_check, signature
from ipydist.torch._wire.compression import AnyCompressor, Compression, describe, sends_as_is
from ipydist.torch._wire.reduce_ops import Average, ReduceOp, Sum
from ipydist.torch.horovod import join
from ipydist.torch.horovod.basics import rank, size
from ipydist.torch.horovod.process_sets import ProcessSet, comms_for, global_process_set
from ipydist.torch.training import optimizer_options as options
from ipydist.torch.training.gradients import buckets, momentum_correction
from ipydist.torch.training.optimizer_options import DEFAULT_BUCKET_CAP_MB, OptimizerOptions
from ipydist.torch.training.optimizer_state import CheckpointMixin
from ipydist.torch.training.wrapping import OutsideTheSet, wrap

#: Attribute on each parameter holding the hook of the DistributedOptimizer that owns it. A
#: notebook re-runs cells, so a second DistributedOptimizer over the same model must take the
#: hooks over, or the first one's hooks would start collectives nobody waits for.
_HOOK_ATTR = "_ipydist_grad_hook"
class _DistributedMixin(CheckpointMixin):
    """Methods mixed into a subclass of the wrapped optimizer's own class."""

    wrapper_name = "DistributedOptimizer"

    def _ipydist_setup(self, given: OptimizerOptions) -> None:
        self._process_set = given.process_set
        self._sparse_as_dense = bool(given.sparse_as_dense)
        group = comms_for(given.process_set)  # raises here if this rank cannot use the set
        options.check_group(given.compression, group)
        params = [
            p for group in self.param_groups for p in group["params"] if p.requires_grad
        ]
        if group is None:  # kept in step after an interrupt, as every rank has it (a
            resync.track_optimizer(self)  # process set's is on its ranks only)
        join.serve_steps_of(self)  # so that a rank in hvd.join() can serve its steps
        self._names = options.names_for(params, given.named_parameters)
        #: The options, as __reduce__ wraps a copy with them.
        self._options = given.named(None if given.named_parameters is None else
                                    [(self._names[id(p)], p) for p in params])
        compression, distributed_after = given.compression, given.distributed_after
        self._compression = compression
        self._distributed_after = distributed_after
        # Steps completed: the same on every rank, and put back in step by the recovery
        # (tracked), since it decides when the compression starts.
        self._steps = torch.zeros((), dtype=torch.int64)
        if (distributed_after or compression.full_precision_steps
                or compression.exchange) and group is None:  # it seeds PowerSGD's Q too
            resync.track_tensors([self._steps])
        self._passes = given.backward_passes_per_step
        self._op = given.op
        # Average divides by the world size before the sum (fewer overflows in 16 bits), or
        # with gradient_predivide_factor f, by f before and by size/f after, as Horovod does.
        ranks = size() if group is None else group.size
        self._prescale, self._postscale = _scales(
            given.op, float(given.gradient_predivide_factor), ranks)
        self._buckets = buckets.plan(
            params, options.cap_bytes(params, given.bucket_cap_mb, given.num_groups),
            options.explicit_groups(given.groups, params),
            buckets.alone_rule(compression, self._full_precision_steps(), group))
        if compression.keeps_momentum and momentum_correction.applies(self):
            for bucket in self._buckets:  # SGD's momentum kept before the exchange (1-bit)
                bucket.correction = momentum_correction.MomentumCorrection(
                    bucket.params, self, 1.0 / (ranks * self._postscale))
        self._corrected = any(b.correction is not None for b in self._buckets)
        self._alone = self._nothing_to_exchange(ranks)
        self._stepped_with: AnyCompressor = Compression.none  # the last synchronize's
        self._slot = {id(p): (b, i) for b, bucket in enumerate(self._buckets)
                      for i, p in enumerate(bucket.params)}
        self._passes_left = {id(p): self._passes for p in params}
        self._next_launch = 0
        # Hooks run on autograd's thread for the parameters' device (the caller's for the
        # CPU): with parameters on the CPU and a GPU, two at once.
        self._launching = threading.Lock()
        self._step_agreed = False  # this step's buckets were checked against the other ranks'
        self._announced: call_check.Announced | None = None  # this step's check, sent ahead
        self._headers: dict[AnyCompressor, np.ndarray] = {}  # what it sends, per compression
        self._plan = [(b.numel, str(b.params[0].dtype), b.params[0].device.type)
                      for b in self._buckets]
        self._grad_marks: list | None = None  # gradients as the last synchronize() left them
        self._alone_synchronized = False  # alone: synchronized since the last backward
        #: Bytes this rank has sent averaging gradients (``transport.bytes_sent``'s model of
        #: the collectives): compressions compared by what they put on the network.
        self.bytes_sent = 0
        self._skip_sync = False
        self._synchronized = False  # synchronize() was called since the last step()
        hook = self._make_hook() if len(self._buckets) > 1 else None
        for p in params:
            old = getattr(p, _HOOK_ATTR, None)
            if old is not None:
                old.remove()
            setattr(p, _HOOK_ATTR, hook and p.register_post_accumulate_grad_hook(hook))

    @property
    def _parameter_names(self) -> dict:
        """Horovod's attribute, which code written for it reads: each parameter -> its name."""
        return {p: name for group in self.param_groups for p in group["params"]
                if (name := self._names.get(id(p))) is not None}

    def _ipydist_resized(self) -> None:
        """The world changed size (``Session.scale``): average over the new number."""
        group = comms_for(self._process_set)
        ranks = size() if group is None else group.size
        self._prescale, self._postscale = _scales(
            self._op, float(self._options.gradient_predivide_factor), ranks)
        self._alone = self._nothing_to_exchange(ranks)
        self._headers.clear()  # they carry the scaling: a step grown from 2 ranks to 3 sent 0.5
        for bucket in self._buckets:
            if bucket.kept is not None:  # e.g. 1-bit's stripes follow the world's size
                bucket.kept.resized(size(), rank())
            if bucket.correction is not None:
                bucket.correction.rescale(1.0 / (ranks * self._postscale))

    def _nothing_to_exchange(self, ranks: int) -> bool:
        """Whether a step has nothing to send: one rank (in the world, or the process set),
        uncompressed and unscaled, where the average of a gradient is the gradient itself.
        Such a step packs, sends and waits for nothing, so that one rank trains as fast as a
        plain optimizer does (on a GPU, the copies into buckets and the one wait for the
        device per step were most of what a step of one rank cost above plain training).
        fp16 and 1-bit compression still round the gradient, and ``sparse_as_dense`` still
        makes it dense, as on more ranks."""
        return (ranks == 1 and sends_as_is(self._compression)
                and self._op in (Average, Sum) and self._prescale == 1.0
                and self._postscale == 1.0 and not self._sparse_as_dense)

    def __reduce__(self):
        """Pickled as what makes it: the wrapped optimizer's class, state and parameter groups,
        and the arguments it was wrapped with. Unpickling wraps a new optimizer again, with
        hooks on its parameters (which a pickled tensor does not carry), its buckets and its
        process set's group: how a replacement rank (``--elastic``) gets rank 0's optimizer.
        Each rank's own state (1-bit residuals) starts afresh; the step count is kept."""
        base = next(c for c in type(self).__mro__ if issubclass(c, torch.optim.Optimizer)
                    and not issubclass(c, _DistributedMixin))
        state = {"defaults": self.defaults, "state": self.state,
                 "param_groups": self.param_groups}
        return _unpickle_distributed, (base, state, self._options.as_keywords(), self._steps)

    def _make_hook(self):
        me = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = me()
            if opt is not None:
                opt._gradient_ready(p)

        return hook

    # --- during backward ----------------------------------------------------------------------

    def _gradient_ready(self, p: torch.Tensor) -> None:
        with self._launching:
            key = id(p)
            self._passes_left[key] -= 1
            if self._passes_left[key] > 0:
                return
            b, i = self._slot[key]
            bucket = self._buckets[b]
            if i in bucket.ready or bucket.exchange is not None:
                raise RuntimeError(
                    f"the gradient of {self._names[key]} was computed again before step(): "
                    "call optimizer.step() (or synchronize()) after each backward, or pass "
                    "backward_passes_per_step=k to accumulate k backward passes."
                )
            bucket.ready.add(i)
            if self._alone:
                self._alone_synchronized = False
                return  # nothing to send (see _nothing_to_exchange)
            while (
                self._next_launch < len(self._buckets)
                and len(self._buckets[self._next_launch].ready)
                == len(self._buckets[self._next_launch].params)
            ):
                self._launch(self._buckets[self._next_launch])
                self._next_launch += 1
            for bucket in self._buckets[:self._next_launch]:  # a chance to move MPI on
                if not bucket.progress():
                    break  # later ones wait behind it

    def _launch(self, bucket: buckets.Bucket) -> None:
        if not self._step_agreed:
            self._agree_on_step()
        bucket.launch(self._compression_now(), self._prescale, comms_for(self._process_set),
                      int(self._steps))
        self.bytes_sent += bucket.sent_bytes

    @waits_for_peers("allreduce of gradients (DistributedOptimizer)")
    def _agree_on_step(self) -> None:
        """Check that every rank sends the same buckets this step. A mismatch leaves nothing
        in flight, so the optimizer works again once the ranks agree."""
        announced, self._announced = self._announced, None
        try:
            if call_check.usable(announced):
                call_check.settle(upto=announced)  # raises on a mismatch
            else:  # none sent (zero_grad not called, a process set's), or the recovery dropped it
                call_check.check("optimizer step", group=comms_for(self._process_set),
                                **self._signature())
        except BaseException:
            self._abandon_pending()
            raise
        self._step_agreed = True

    def _signature(self) -> dict:
        """What the other ranks' steps must match: bucket sizes, dtype, device, op, scaling."""
        first = self._buckets[0].params[0]  # only called when there are buckets
        return dict(dtype=first.dtype, device=first.device,
                    shape=[b.numel for b in self._buckets], op=self._op,
                    prescale=self._prescale, postscale=self._postscale,
                    extra=signature.plan_hash(self._plan + [describe(self._compression_now())]))

    def _full_precision_steps(self) -> int:
        """Steps averaged in full precision before the compression starts: the warm start
        (``distributed_after``), or the compression's own (PowerSGD's ``start_iter``)."""
        return max(self._distributed_after, self._compression.full_precision_steps)

    def _compression_now(self) -> AnyCompressor:
        """The compression of this step: none during the warm start."""
        warm = self._full_precision_steps()
        if warm and int(self._steps) < warm:
            return Compression.none
        return self._compression

    # --- at step ------------------------------------------------------------------------------

    @waits_for_peers("allreduce of gradients (DistributedOptimizer)")
    def synchronize(self) -> None:
        """Finish averaging every gradient over the ranks (collective: every rank calls it).

        A second call with no backward in between does nothing, so ``synchronize()`` followed
        by ``step()`` averages once.
        """
        self._synchronized = True
        if self._alone:  # one rank: every gradient is already its own average
            if not self._alone_synchronized:
                self._end_step(marks=False)
            return
        if self._grad_marks == self._current_marks():
            return
        process_group.ensure()
        with self._launching:
            while self._next_launch < len(self._buckets):
                self._launch(self._buckets[self._next_launch])
                self._next_launch += 1
        self._stepped_with = self._compression_now()
        for bucket in self._buckets:
            t0 = time.perf_counter()
            bucket.finish()
            waiting.note_wait(time.perf_counter() - t0)  # for the live view's straggler strip
            if events.recording:
                events.record("ALLREDUCE", bucket.launched, time.perf_counter(),
                              bucket=self._names.get(id(bucket.params[0])),
                              parameters=len(bucket.params), bytes=bucket.sent_bytes)
        # written only once every bucket is in and the group is known usable (see unpack)
        buckets.unpack(self._buckets, self._prescale, self._postscale, self._sparse_as_dense)
        self._end_step()

    def _end_step(self, marks: bool = True) -> None:
        """After a step's gradients are averaged. ``marks``: remember the gradients, so that a
        second synchronize() with no backward between does nothing. A rank alone skips that
        look at every gradient (3 % of a small model's step on the CPU): a backward (the
        hooks) or zero_grad() since its last synchronize() says whether one is due."""
        for bucket in self._buckets:
            bucket.ready.clear()
        self._next_launch = 0
        self._step_agreed = False
        self._passes_left = dict.fromkeys(self._passes_left, self._passes)
        self._grad_marks = self._current_marks() if marks else None
        self._alone_synchronized = not marks
        self._steps += 1

    def _abandon_pending(self) -> None:
        """Forget a gradient averaging that a failed or interrupted cell left half done (its
        collectives are void: the group is rebuilt where they broke it), so the next cell can
        call ``zero_grad()`` and train on."""
        for bucket in self._buckets:
            bucket.abandon()
            if bucket.kept is not None:  # the ranks may now disagree on what it shares
                bucket.kept.restart()
        self._next_launch = 0
        self._step_agreed = False
        self._announced = None  # the recovery replaces the communicator it was sent on
        self._passes_left = dict.fromkeys(self._passes_left, self._passes)
        self._grad_marks = None
        self._alone_synchronized = False
        self._synchronized = False  # a synchronize() a release ended is not one to warn of

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
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): it checks the gradients again for nothing. Step "
                    "inside `with optimizer.skip_synchronize():` after synchronizing yourself.",
                    stacklevel=2)
            self.synchronize()
        self._synchronized = False
        waiting.check_usable()  # a released rank does not step (see buckets.unpack)
        corrected = self._corrected and self._stepped_with.keeps_momentum
        with momentum_correction.plain_step(self) if corrected else contextlib.nullcontext():
            return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(b.exchange is not None for b in self._buckets):
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); call zero_grad() before backward."
            )
        super().zero_grad(set_to_none=set_to_none)
        self._alone_synchronized = False
        if (self._announced is None and self._buckets and not self._step_agreed
                and self._process_set is global_process_set and not self._alone):
            compression = self._compression_now()
            if compression not in self._headers:
                self._headers[compression] = np.asarray(
                    signature.header("optimizer step", **self._signature()), dtype=np.int64)
            self._announced = call_check.announce(self._headers[compression])

    # --- for hvd.join() (its StepServer protocol) ---------------------------------------------

    def serves_step(self, words: list[int]) -> bool:
        """Whether the step the other ranks announced (``words``, their header) is one of
        this optimizer's: join serves the world's steps, which a process set's optimizer
        does not take part in (its steps go over the set's own communicators)."""
        return bool(self._buckets) and self._process_set is global_process_set \
            and words == signature.header("optimizer step", **self._signature())

    def serve_joined_step(self) -> None:
        """Take part in the other ranks' step with no gradients (zeros, as Horovod's joined
        ranks send), its check already made."""
        for bucket in self._buckets:
            for p in bucket.params:
                p.grad = None
        self._grad_marks, self._announced, self._step_agreed = None, None, True
        self.synchronize()
        self._synchronized = False


def _scales(op: ReduceOp, f: float, ranks: int) -> tuple[float, float]:
    """(before the sum, after it): Average divides by the number of ranks before the sum
    (fewer overflows in 16 bits), or with gradient_predivide_factor f, by f before and by
    ranks/f after, as Horovod does."""
    pre = 1.0 if op is Sum else (1.0 / f if f != 1.0 else 1.0 / ranks)
    return pre, (f / ranks if op is Average and f != 1.0 else 1.0)


def _unpickle_distributed(base: type[torch.optim.Optimizer], state: dict, wrapped_with: dict,
                          steps: torch.Tensor):
    optimizer = base.__new__(base)  # type: ignore[call-overload]  # torch skipped: type[Any]
    optimizer.__setstate__(state)
    wrapped = DistributedOptimizer(optimizer, **wrapped_with)
    wrapped._steps.copy_(steps)
    return wrapped


def DistributedOptimizer(  # noqa: N802 - Horovod's name, a factory like Horovod's
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression: AnyCompressor = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    distributed_after: int = 0,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of the optimizer's own class (LR schedulers accept it) sharing the
    original's state. ``backward_passes_per_step=k`` sums k local backward passes before one
    allreduce (scale the loss by 1/k for the mean, as with any gradient accumulation).
    Call ``synchronize()`` then step inside ``skip_synchronize()`` to clip averaged gradients.

    ``distributed_after=n`` (CNTK's name) warm-starts a compression: the first n steps average
    gradients in full precision, the later ones use ``compression``. CNTK counts samples and
    trains as one worker before; here it counts optimizer steps (a torch optimizer never sees
    the batch) and every rank trains on its own data from the first step.
    ``Compression.powersgd(rank=r, start_iter=n)`` has a warm start of its own (DDP's
    ``start_powerSGD_iter``): the larger of the two holds.

    Horovod's arguments: ``process_set`` averages among a process set's ranks (only they step
    it); ``num_groups=n`` fuses the gradients into about n buckets, ``groups`` (lists of
    parameters) fuses each list into buckets of its own, where the default is buckets of
    ``bucket_cap_mb``; sparse gradients (``nn.Embedding(sparse=True)``) are averaged densely
    and come back sparse, as the optimizer gave them (SparseAdam needs them so). A rank outside
    ``process_set`` may make it too, as in Horovod: its steps average nothing.
    """
    given = OptimizerOptions(**{name: value for name, value in locals().items()
                                if name != "optimizer"})  # the arguments, by name
    if is_distributed(optimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if process_set is not global_process_set and process_set.included() is False:
        return wrap(optimizer, OutsideTheSet)
    wrapped = wrap(optimizer, _DistributedMixin)
    wrapped._ipydist_setup(given)
    return wrapped


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is already a DistributedOptimizer (wrapping it again would
    average every gradient twice)."""
    return isinstance(optimizer, _DistributedMixin)
