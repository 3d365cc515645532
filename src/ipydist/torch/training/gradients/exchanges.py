"""How one bucket's gradients travel in a step, one object per way, each holding its own state
(as PyTorch's DDP communication hooks keep one hook and one state object per algorithm):

- :class:`Packed`: the bucket's packed buffer (gradients, then one had-gradient flag per
  parameter) summed by one allreduce, over MPI or the process group, cast to 16 bits and back
  where the compression says so (``Compression.fp16``, ``.bf16``);
- :class:`InPlace`: one large gradient summed where it lies, over MPI, followed by its flag,
  with no pack and no unpack (uncompressed only);
- a compression's own exchange, kept by the bucket from one step to the next with its state
  (:class:`KeptExchange`): 1-bit SGD's
  (:class:`~ipydist.torch.training.gradients.onebit_exchange.OneBitExchange`), PowerSGD's
  (:class:`~ipydist.torch.training.gradients.powersgd.PowerSGDExchange`), named by the
  compressor (``Compressor.exchange``).

Every one is started by :meth:`Bucket.launch
<ipydist.torch.training.gradients.buckets.Bucket.launch>`
and then answers the same questions (:class:`Exchange`): has it moved on, wait for it, which
flags must this rank read, and write the averaged gradients. A kept one also says what a
checkpoint keeps of it, and what it does when the ranks may disagree on what it shares or the
world changes size.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from ipydist.torch._core import topology, waiting
from ipydist.torch._wire import transport
from ipydist.torch._wire.compression import AnyCompressor, Compressor
from ipydist.torch._wire.starts import torch_group_of

if TYPE_CHECKING:
    from ipydist.torch.training.gradients.buckets import Bucket


class Exchange(Protocol):
    """A bucket's gradients on their way, in one step."""

    #: What this rank sends in it (``transport.bytes_sent``'s model).
    sent_bytes: int

    def progress(self) -> bool:
        """Let it move on (MPI moves only inside its calls); True once done."""
        ...

    def finish(self) -> None:
        """Wait for it (a release ends the wait); on a GPU, order the step's stream after it."""
        ...

    def to_read(self) -> list[torch.Tensor]:
        """Take the result for :meth:`write` (on a GPU only queued), and return the summed
        had-gradient flags this rank must read: those of the parameters it had none for."""
        ...

    def write(self, bucket: Bucket, flags: list, prescale: float, postscale: float,
              sparse_as_dense: bool) -> None:
        """Write the averaged gradients into ``bucket``'s parameters (``flags``: the values
        of what :meth:`to_read` asked for, in its order), once the group is known usable."""
        ...


class KeptExchange(Exchange, Protocol):
    """A compression's exchange, which the bucket keeps between steps with its state (error
    feedback; what the ranks share, such as PowerSGD's Q)."""

    #: The key of its per-rank state in a checkpoint.
    name: ClassVar[str]

    @classmethod
    def for_bucket(cls, bucket: Bucket, compression: Any, world: int,
                   rank: int) -> KeptExchange:
        """Made on the bucket's first step with it, among ``world`` ranks, on ``rank``."""
        ...

    def start(self, flat: torch.Tensor, step: int) -> None:
        """Start this step's exchange of ``flat`` (the bucket's prescaled values, then its
        had-gradient flags); ``step``: the optimizer's steps so far, the same on every rank."""
        ...

    def abandon(self) -> None:
        """Forget the step in flight (done, or void after a release)."""
        ...

    def restart(self) -> None:
        """The ranks may disagree on what the exchange shares (after a recovery or a heal):
        every rank drops it, and they make it again alike."""
        ...

    def resized(self, world: int, rank: int) -> None:
        """The world is now ``world`` ranks, this one ``rank``."""
        ...

    def state(self) -> dict:
        """This rank's own state, on the CPU, for a checkpoint."""
        ...

    def load(self, state: dict) -> None:
        """Take back what :meth:`state` gave."""
        ...


def kept_exchange(compression: AnyCompressor) -> type[KeptExchange] | None:
    """The exchange class ``compression`` names (None: the packed allreduce)."""
    if compression.exchange is None:
        return None
    module, _, name = compression.exchange.partition(":")
    return getattr(importlib.import_module(module), name)


def _bytes_sent(group, *tensors: torch.Tensor) -> int:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    owner = topology.get() if group is None else group
    assert owner is not None  # a step runs on a rank
    return transport.bytes_sent("allreduce", nbytes, owner.size)


def had_gradient(staged: list, flags: list) -> list[bool]:
    """Whether some rank had a gradient for each parameter: ``staged`` holds True (this rank
    had one), a summed flag, or None where the value was read (``flags``, in order)."""
    read = iter(flags)
    return [(next(read) if h is None else h) > 0 for h in staged]


class Packed:
    """The packed buffer summed by one allreduce (see the module docstring)."""

    def __init__(self, flat: torch.Tensor, numel: int, views: list[torch.Tensor],
                 had: list[bool], compression: AnyCompressor, group=None) -> None:
        self.buffer, self.numel, self.views, self.had = flat, numel, views, had
        self.compression = compression
        self.wire, self.ctx = compression.compress(flat)
        self.sent_bytes = _bytes_sent(group, self.wire)
        self.mpi = transport.uses_mpi(self.wire, group)
        if self.mpi:
            self.work: Any = transport.start_allreduce(self.wire, group=group)
        else:
            self.work = dist.all_reduce(self.wire, op=dist.ReduceOp.SUM, async_op=True,
                                        group=torch_group_of(group, self.wire))
        self.staged: tuple[list, list] | None = None

    def progress(self) -> bool:
        return not self.mpi or transport.progress(self.work)

    def finish(self) -> None:
        """On a GPU the wait only orders the device's stream after it: ``unpack`` is where
        the host waits for the device."""
        if self.mpi:
            transport.finish(self.work)
        else:
            waiting.wait_for(self.work, on_device=self.wire.device.type != "cpu")

    def to_read(self) -> list[torch.Tensor]:
        flat = self._decompressed()
        views = self.views if flat is self.buffer else flat[:self.numel].split(
            [v.numel() for v in self.views])
        flags = flat[self.numel:]
        self.staged = list(views), [True if had else None for had in self.had]
        return [flags[i] for i, had in enumerate(self.had) if not had]

    def _decompressed(self) -> torch.Tensor:
        """The received buffer in the gradients' dtype. A cast back (fp16, bf16) goes into the
        bucket's own buffer, free since the cast out: a new tensor would stay alive, with
        every other bucket's, until the step's last bucket is in (``unpack``)."""
        if self.wire is self.buffer:
            return self.buffer
        if (self.compression.decompress is Compressor.decompress
                and self.ctx == self.buffer.dtype):
            return self.buffer.copy_(self.wire)
        return self.compression.decompress(self.wire, self.ctx)

    def write(self, bucket: Bucket, flags: list, prescale: float, postscale: float,
              sparse_as_dense: bool) -> None:
        assert self.staged is not None  # to_read staged it
        values, staged = self.staged
        bucket.write_gradients(values, had_gradient(staged, flags), postscale)


class InPlace:
    """One large gradient summed where it lies, over MPI (see the module docstring)."""

    def __init__(self, param: torch.nn.Parameter, group=None) -> None:
        grad = dense(param.grad)
        self.had = grad is not None
        self.sent = torch.zeros_like(param) if grad is None else (
            grad if grad.is_contiguous() else grad.contiguous())
        self.flag = torch.tensor([float(grad is not None)], dtype=param.dtype)
        self.sent_bytes = _bytes_sent(group, self.sent, self.flag)
        self.work = transport.start_allreduce(self.sent, also=[self.flag], group=group)

    def progress(self) -> bool:
        return transport.progress(self.work)

    def finish(self) -> None:
        transport.finish(self.work)

    def to_read(self) -> list[torch.Tensor]:
        return [] if self.had else [self.flag[0]]

    def write(self, bucket: Bucket, flags: list, prescale: float, postscale: float,
              sparse_as_dense: bool) -> None:
        """The sum is the gradient itself, unscaled: scaled here, once."""
        (had,) = had_gradient([True if self.had else None], flags)
        p, sent, scale = bucket.params[0], self.sent, prescale * postscale
        if had:  # some rank had a gradient
            was_sparse = p.grad is not None and p.grad.is_sparse
            if p.grad is None or was_sparse:
                p.grad = sent
            elif sent is not p.grad:
                p.grad.copy_(sent)
            if scale != 1.0:
                p.grad.mul_(scale)
            if was_sparse:
                p.grad = p.grad.to_sparse(1)


def dense(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient as it travels: sparse ones (``nn.Embedding(sparse=True)``) as dense, as
    Horovod's ``sparse_as_dense`` sends them."""
    return grad.to_dense() if grad is not None and grad.is_sparse else grad
