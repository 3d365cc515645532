"""One gradient bucket's 1-bit exchange over MPI or the process group, and the residuals it
keeps between steps (the arithmetic is :mod:`ipydist.torch.training.gradients.onebit`).

A step: this rank quantizes its gradients plus its residual, one message per stripe, and sends
each stripe's owner its message (an all-to-all); each owner sums the messages of its stripe,
quantizes the sum plus its owner residual, and every rank gathers every owner's message (an
allgather) and decodes the whole sum. Both residuals (and the velocity of a momentum correction,
:mod:`ipydist.torch.training.gradients.momentum_correction`) take their new values only when the
step completes, so a step that a release abandons leaves them as the last completed step did.

Where a bucket lies decides the rest. On the CPU the numba loops quantize and MPI (or gloo) moves
the messages. On a GPU the torch operations of
:mod:`ipydist.torch.training.gradients.onebit_torch` quantize in the GPU's memory, the same
messages byte for byte, and torch.distributed moves them on the device: with NCCL, the all-to-all,
the owner's step, the allgather and the decoding are all queued from the gradient hook on a side
stream, with no wait on the host, and ``finish`` only makes the step's stream wait for that one
(DDP's overlap: backward's own kernels never wait for the network). The messages are not copied to
the host for MPI: that copy would make the hook wait for the GPU, and MPI here carries CPU tensors
only, where NCCL takes GPU memory directly. The one wait on the host is at ``step()``: the
had-gradient flags are read back to decide which gradients stay ``None`` (as the full-precision
path reads them). A backend that is not NCCL (gloo on GPU tensors) runs the owner's step and the
allgather in ``finish``, as gloo does on the CPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ipydist.torch._core import process_group, waiting
from ipydist.torch._wire import transport
from ipydist.torch._wire.starts import torch_group_of
from ipydist.torch.training.gradients import onebit, onebit_torch
from ipydist.torch.training.gradients.momentum_correction import MomentumCorrection


class Arithmetic(Protocol):
    """The 1-bit arithmetic of one device kind, one module each with the same message format
    byte for byte: :mod:`~ipydist.torch.training.gradients.onebit` (numba loops, the CPU) and
    :mod:`~ipydist.torch.training.gradients.onebit_torch` (torch operations, a GPU; the CPU in
    tests). The exchange picks one per step, by where the bucket lies; the type check holds both
    modules to these three functions."""

    def quantize_stripes(self, x: torch.Tensor, extra: torch.Tensor, residual: torch.Tensor,
                         out: torch.Tensor, world: int,
                         momentum: onebit.Momentum | None = None) -> torch.Tensor:
        """This rank's message for each stripe of ``x`` plus ``residual`` (``out``: the
        residual it leaves)."""
        ...

    def requantize_stripe(self, rows: torch.Tensor, numel: int, extra: int,
                          residual: torch.Tensor, out: torch.Tensor,
                          total: torch.Tensor | None = None) -> torch.Tensor:
        """The owner's step: its stripe summed over the ranks, quantized again."""
        ...

    def assemble(self, gathered: torch.Tensor, numel: int, extra: int,
                 into: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        """The whole sum from every owner's message, and the summed extras."""
        ...


#: torch.distributed's allgather into one tensor (``all_gather_single`` where torch has it:
#: there the old name warns).
_allgather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OneBitExchange:
    """The exchange of a bucket of ``numel`` values and ``extra`` exact float32 values (the
    had-gradient flags) among ``world`` ranks, seen from rank ``rank``; with ``correction``,
    SGD's momentum is kept on this rank and sent instead of the gradients. A bucket's kept
    exchange (``exchanges.KeptExchange``) for ``Compression.onebit``."""

    #: The key of its per-rank state in a checkpoint.
    name = "onebit"

    #: Quantize CPU buckets with the torch operations too (the tests compare the two paths
    #: on one machine; on a GPU they are the only path).
    torch_on_cpu = False

    def __init__(self, numel: int, extra: int, world: int, rank: int,
                 correction: MomentumCorrection | None = None) -> None:
        self.numel, self.extra, self.world = numel, extra, world
        self.correction = correction
        start, stop = onebit.stripes(numel, world)[rank]
        self.own = stop - start  # values in this rank's stripe
        #: What this rank has not sent of its gradients, and what it did not send of its
        #: stripe's sums (error feedback, both); the ``next_`` ones are this step's. Made on
        #: the CPU, moved to the bucket's device by its first step (``_place``).
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self.owner_residual = torch.zeros(self.own, dtype=torch.float32)
        self.next_residual = torch.empty_like(self.residual)
        self.next_owner_residual = torch.empty_like(self.owner_residual)
        # the decoded sums, kept between steps: a fresh buffer of this size costs more in page
        # faults than the decoding (the owner sums its stripe in the front of it first)
        self._total = torch.empty(numel, dtype=torch.float32)
        self.work: Any = None  # the exchange in flight: an MPI chain (``mpi``) or a torch Work
        self.mpi = False
        self._buffers: dict[str, torch.Tensor] = {}
        #: The arithmetic for this step's device: the module onebit or onebit_torch.
        self._ops: Arithmetic = onebit
        self._stream: torch.cuda.Stream | None = None  # NCCL: where the exchange is queued
        self._result: tuple | None = None  # the decoded sum, once queued or computed
        self._staged: tuple | None = None  # the sum and the summed flags, for write
        #: What this rank sent in the last step (``transport.bytes_sent``'s model).
        self.sent_bytes = 0

    @classmethod
    def for_bucket(cls, bucket: Any, compression: Any, world: int,
                   rank: int) -> OneBitExchange:
        return cls(bucket.numel, len(bucket.params), world, rank, bucket.correction)

    def _place(self, device: torch.device) -> None:
        """Move the residuals and buffers to ``device`` (once: the first step, or the first
        after a checkpoint was loaded), without waiting on the host."""
        if self.residual.device == device:
            return

        def moved(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and device.type == "cuda":
                t = t.pin_memory()  # a copy from pinned memory does not synchronize
            return t.to(device, non_blocking=True)

        self.residual, self.owner_residual = moved(self.residual), moved(self.owner_residual)
        self.next_residual = torch.empty_like(self.residual)
        self.next_owner_residual = torch.empty_like(self.owner_residual)
        self._total = torch.empty(self.numel, dtype=torch.float32, device=device)

    def start(self, flat: torch.Tensor, step: int = 0) -> None:
        """Start the exchange of ``flat`` (values, then extras); :attr:`sent_bytes` is what
        this rank sends in it (``transport.bytes_sent``'s model)."""
        device = flat.device
        on_cpu = device.type == "cpu" and not self.torch_on_cpu
        if on_cpu:  # each branch apart, so that the type check holds each module to it
            self._ops = onebit
        else:
            self._ops = onebit_torch
        self._stream = _side_stream(device)
        self._result = None
        if self._stream is not None:  # the gradients were packed on backward's stream
            self._stream.wait_stream(torch.cuda.current_stream(device))
        with _on(self._stream):
            self._place(device)
            send = self._quantize(flat)
            recv, gathered = torch.empty_like(send), torch.empty_like(send)
            self._buffers = dict(send=send, recv=recv, gathered=gathered)
            self.mpi = transport.uses_mpi(send)
            if self.mpi:
                self.work = transport.start_alltoall_then_allgather(send, recv,
                                                                    self._owner_step, gathered)
            else:
                self.work = dist.all_to_all_single(recv.view(-1), send.view(-1), async_op=True,
                                                   group=torch_group_of(None, send))
            if self._stream is not None:  # the rest queued behind it, on the device
                waiting.wait_for(self.work, on_device=True)  # the side stream waits, not the host
                self._gather()
                self._result = self._ops.assemble(gathered, self.numel, self.extra, self._total)
        self.sent_bytes = (transport.bytes_sent("alltoall", send.numel(), self.world)
                           + transport.bytes_sent("allgather", send.shape[1], self.world))

    def _quantize(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's message for each stripe (what ``start`` sends)."""
        values, momentum = flat[:self.numel], None
        if self.correction is not None:
            values = values.to(torch.float32)  # in place when it is already float32
            momentum = self.correction.fused(values)
            if momentum is None:  # param groups of different settings: a pass of its own
                values = self.correction.apply(values)
        return self._ops.quantize_stripes(values, flat[self.numel:], self.residual,
                                          self.next_residual, self.world, momentum)

    def _owner_step(self) -> torch.Tensor:
        """This rank's stripe summed over the ranks, as the message every rank gathers."""
        message = self._ops.requantize_stripe(self._buffers["recv"], self.own, self.extra,
                                              self.owner_residual, self.next_owner_residual,
                                              self._total[:self.own])
        self._buffers["message"] = message  # alive until the allgather is done
        return message

    def _gather(self) -> None:
        """The owner's step and the allgather of every owner's message, queued (NCCL) or
        waited for (gloo)."""
        gathered = self._buffers["gathered"]
        work = _allgather(gathered.view(-1), self._owner_step(), async_op=True,
                          group=torch_group_of(None, gathered))
        waiting.wait_for(work, on_device=self._stream is not None)  # NCCL: the stream waits

    def progress(self) -> bool:
        """Move an MPI exchange on; True once done (a gloo one is finished in ``finish``, an
        NCCL one is queued on the device)."""
        return not self.mpi or transport.progress(self.work)

    def finish(self) -> None:
        """Wait for the exchange (a release ends the wait); on a GPU with NCCL, make the
        current stream wait for it (the host does not)."""
        if self.mpi:
            transport.finish(self.work)
        elif self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        else:
            waiting.wait_for(self.work)
            self._gather()

    def result(self) -> tuple[torch.Tensor, list]:
        """The sum over the ranks (float32 on the bucket's device, the same on every rank) and
        the summed extras; the step's residuals become the current ones. On a GPU, reading
        the extras is where the host waits for the step's exchange."""
        total, extras = self._result or self._ops.assemble(
            self._buffers["gathered"], self.numel, self.extra, self._total)
        if isinstance(extras, torch.Tensor):
            extras = extras.tolist()  # on a GPU, the host waits here for the exchange
            waiting.check_usable()  # an NCCL abort ends its kernels early, with no error
        self.residual, self.next_residual = self.next_residual, self.residual
        self.owner_residual, self.next_owner_residual = (self.next_owner_residual,
                                                         self.owner_residual)
        if self.correction is not None:
            self.correction.commit()
        self.abandon()
        return total, extras

    def abandon(self) -> None:
        """Forget the exchange in flight (done, or void after a release)."""
        self.work = None
        self._buffers = {}
        self._result = None
        self._staged = None

    def restart(self) -> None:
        """Nothing is shared between ranks: the residuals are each rank's own, and kept."""
        self.abandon()

    def resized(self, world: int, rank: int) -> None:
        """The stripes follow the new world: this rank's owner residual (of a stripe that is
        no longer its) starts afresh; its own residual, what it did not send, is kept."""
        self.abandon()
        self.world = world
        start, stop = onebit.stripes(self.numel, world)[rank]
        self.own = stop - start
        device = self.residual.device
        self.owner_residual = torch.zeros(self.own, dtype=torch.float32, device=device)
        self.next_owner_residual = torch.empty_like(self.owner_residual)

    # --- as a bucket's exchange (exchanges.Exchange) ---------------------------------------

    def to_read(self) -> list[torch.Tensor]:
        """Take the sum (see :meth:`result`); the flags come with it, summed: none to read."""
        total, had = self.result()
        self._staged = total, had
        return []

    def write(self, bucket: Any, flags: list, prescale: float, postscale: float,
              sparse_as_dense: bool) -> None:
        assert self._staged is not None  # to_read staged it
        total, had = self._staged
        self._staged = None
        bucket.write_gradients(total.split([p.numel() for p in bucket.params]),
                               [h > 0 for h in had], postscale)

    # --- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        """This rank's residuals (and velocity), on the CPU whatever the bucket's device: a
        checkpoint loads on a machine without the GPU, and is gathered as CPU tensors."""
        state = {"residual": self.residual.to("cpu", copy=True),
                 "owner_residual": self.owner_residual.to("cpu", copy=True)}
        if self.correction is not None:
            state["velocity"] = self.correction.state()
        return state

    def load(self, state: dict) -> None:
        self.residual.copy_(state["residual"])
        self.owner_residual.copy_(state["owner_residual"])
        if self.correction is not None:
            self.correction.load(state.get("velocity"))


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream a bucket's exchange is queued on, one per GPU: where NCCL serves the
    device's tensors (its collectives are ordered on streams), else None (the host waits)."""
    if device.type != "cuda" or not process_group.nccl_serves_cuda():
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


_streams: dict[int, torch.cuda.Stream] = {}


def _on(stream: torch.cuda.Stream | None):
    """Queue what follows on ``stream`` (its allocations are that stream's too), or run it
    where it is (the CPU, or a GPU whose backend is not NCCL)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
