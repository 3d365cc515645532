"""One gradient bucket's 1-bit exchange over MPI or the process group, and the residuals it
keeps between steps (the arithmetic is :mod:`ipydist.torch.training.onebit`).

A step: this rank quantizes its gradients plus its residual, one message per stripe, and sends
each stripe's owner its message (an all-to-all); each owner sums the messages of its stripe,
quantizes the sum plus its owner residual, and every rank gathers every owner's message (an
allgather) and decodes the whole sum. Both residuals (and the velocity of a momentum
correction, :mod:`ipydist.torch.training.momentum_correction`) take their new values only when the
step completes, so a step that a release abandons leaves them as the last completed step did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ipydist.torch._core import waiting
from ipydist.torch._wire import transport
from ipydist.torch.training import onebit
from ipydist.torch.training.momentum_correction import MomentumCorrection


class OneBitExchange:
    """The exchange of a bucket of ``numel`` values and ``extra`` exact float32 values (the
    had-gradient flags) among ``world`` ranks, seen from rank ``rank``; with ``correction``,
    SGD's momentum is kept on this rank and sent instead of the gradients."""

    def __init__(self, numel: int, extra: int, world: int, rank: int,
                 correction: MomentumCorrection | None = None) -> None:
        self.numel, self.extra, self.world = numel, extra, world
        self.correction = correction
        start, stop = onebit.stripes(numel, world)[rank]
        self.own = stop - start  # values in this rank's stripe
        #: What this rank has not sent of its gradients, and what it did not send of its
        #: stripe's sums (error feedback, both); the ``next_`` ones are this step's.
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self.owner_residual = torch.zeros(self.own, dtype=torch.float32)
        self.next_residual = torch.empty_like(self.residual)
        self.next_owner_residual = torch.empty_like(self.owner_residual)
        # the decoded sums, kept between steps: a fresh buffer of this size costs more in page
        # faults than the decoding (the owner sums its stripe in the front of it first)
        self._total = torch.empty(numel, dtype=torch.float32)
        self.work = None
        self.mpi = False
        self._buffers: dict[str, torch.Tensor] = {}

    def start(self, flat: torch.Tensor) -> int:
        """Start the exchange of ``flat`` (values, then extras); returns the bytes this rank
        sends in it (``transport.bytes_sent``'s model)."""
        values, momentum = flat[:self.numel], None
        if self.correction is not None:
            values = values.to(torch.float32)  # in place when it is already float32
            momentum = self.correction.fused(values)
            if momentum is None:  # param groups of different settings: a pass of its own
                values = self.correction.apply(values)
        send = onebit.quantize_stripes(values, flat[self.numel:], self.residual,
                                       self.next_residual, self.world, momentum)
        recv, gathered = torch.empty_like(send), torch.empty_like(send)
        self._buffers = dict(send=send, recv=recv, gathered=gathered)
        self.mpi = transport.uses_mpi(send)
        if self.mpi:
            self.work = transport.start_alltoall_then_allgather(send, recv, self._owner_step,
                                                                gathered)
        else:
            self.work = dist.all_to_all_single(recv.view(-1), send.view(-1), async_op=True)
        return (transport.bytes_sent("alltoall", send.numel(), self.world)
                + transport.bytes_sent("allgather", send.shape[1], self.world))

    def _owner_step(self) -> torch.Tensor:
        """This rank's stripe summed over the ranks, as the message every rank gathers."""
        message = onebit.requantize_stripe(self._buffers["recv"], self.own, self.extra,
                                           self.owner_residual, self.next_owner_residual,
                                           self._total[:self.own])
        self._buffers["message"] = message  # alive until the allgather is done
        return message

    def progress(self) -> bool:
        """Move an MPI exchange on; True once done (a gloo one is finished in ``finish``)."""
        return not self.mpi or transport.progress(self.work)

    def finish(self) -> None:
        """Wait for the exchange (a release ends the wait)."""
        if self.mpi:
            transport.finish(self.work)
            return
        waiting.wait_for(self.work)
        gathered = self._buffers["gathered"]
        waiting.wait_for(dist.all_gather_into_tensor(gathered.view(-1), self._owner_step(),
                                                     async_op=True))

    def result(self) -> tuple[torch.Tensor, list]:
        """The sum over the ranks (float32, the same on every rank) and the summed extras;
        the step's residuals become the current ones."""
        total, extras = onebit.assemble(self._buffers["gathered"], self.numel, self.extra,
                                        self._total)
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

    # --- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        state = {"residual": self.residual.clone(), "owner_residual": self.owner_residual.clone()}
        if self.correction is not None:
            state["velocity"] = self.correction.state()
        return state

    def load(self, state: dict) -> None:
        self.residual.copy_(state["residual"])
        self.owner_residual.copy_(state["owner_residual"])
        if self.correction is not None:
            self.correction.load(state.get("velocity"))
