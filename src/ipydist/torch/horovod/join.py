"""``hvd.join()``: a rank that has run out of data waits for the others, taking part in their
allreduces with a neutral tensor meanwhile, as Horovod's joined ranks do.

Data that does not divide evenly gives some ranks one batch fewer. In Horovod such a rank
calls ``hvd.join()`` and the others train on: each of their allreduces gets zeros from it
(still divided by the full ``size()`` for Average), and ``join()`` returns on every rank once
all have called it, with the rank that joined last.

ipydist learns what the others are doing from the check every collective makes first
(:mod:`ipydist.torch._wire.call_check`): a joined rank sends a "join" header in each exchange,
reads the others' headers, and posts the matching allreduce with a neutral tensor (zeros for
Sum and Average, ones for Product, the dtype's extremes for Min and Max: Horovod's zeros
would corrupt those), or the step of the DistributedOptimizer whose buckets they announce
with no gradients. Anything else the others call raises on each of them (the joined rank sits
it out), so nothing hangs. The check must be on (it is by default).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from ipydist.torch._core import process_group, topology
from ipydist.torch._core.marks import waits_for_peers
from ipydist.torch._wire import call_check, signature
from ipydist.torch._wire.reduce_ops import Max, Min, Product, ReduceOp
from ipydist.torch._wire.signature import CARRIED, DEVICE, DIMS, DTYPE, KIND, NDIM, OP, from_bits
from ipydist.torch._wire.starts import start_allreduce


class StepServer(Protocol):
    """What a joined rank serves besides allreduces: a training step announced by the others
    (DistributedOptimizer registers itself with :func:`serve_steps_of`; join needs nothing
    else of it, and the training layer stays above this one)."""

    def serves_step(self, words: list[int]) -> bool:
        """Whether the step the other ranks announced (``words``, their header) is this one's."""

    def serve_joined_step(self) -> None:
        """Take part in the others' step with no gradients, its check already made."""


#: Every step server alive on this rank, oldest first (a dict keeps the order of insertion,
#: a set does not).
_servers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def serve_steps_of(server: StepServer) -> None:
    """Let a rank in ``join()`` serve ``server``'s steps when the others announce one."""
    _servers[server] = None


def _server_for(words: list[int]) -> StepServer | None:
    """The newest step server whose step the others announced: a cell run again leaves the
    optimizer it made before alive (in ``Out``, in a closure) with the same parameters'
    shapes, and the others step the new one; a set's iteration order would pick either."""
    return next((s for s in reversed(list(_servers)) if s.serves_step(words)), None)


for _op in ReduceOp:  # so that the ops the others name can be read back
    signature.code(_op.name)


@waits_for_peers("join")
def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``, serving the others' allreduces and
    DistributedOptimizer steps with neutral values meanwhile (collective: every rank calls it
    once it has no more data). Returns the rank that joined last, the same on every rank.
    ``device`` is Horovod's; the rank's own device is used."""
    rt = process_group.ensure()
    if rt.size == 1:
        return rt.rank
    if not call_check.enabled():
        raise RuntimeError(
            "hvd.join() learns what the other ranks call from the collective check, which is "
            "off: turn it on on every rank (ipydist.torch.call_check.set_enabled(True), or "
            "leave IPYDIST_CHECK_COLLECTIVES unset)")
    first = True
    while True:
        headers = call_check.exchange_joined(first)
        first = False
        if all(h[KIND] == signature.JOIN for h in headers):
            # those whose first join header this is joined last
            return max(r for r, h in enumerate(headers) if h[CARRIED])
        if signature.disagreement(headers) is not None:
            continue  # the others raise; this rank waits for their next call
        _serve(next(h for h in headers if h[KIND] != signature.JOIN), rt)


def _serve(words: list[int], rt: topology.Runtime) -> None:
    kind = signature.KINDS[words[KIND] - 1]
    if kind == "allreduce":
        start_allreduce(_neutral(words, rt), ReduceOp[signature.name_of(words[OP])],
                        from_bits(words[signature.PRESCALE]),
                        from_bits(words[signature.POSTSCALE]), checked=True).wait()
    elif kind == "optimizer step":
        serving = _server_for(words)
        if serving is None:
            raise RuntimeError(
                "hvd.join(): the other ranks stepped a DistributedOptimizer that this rank "
                "does not have (none here has the same parameters and settings), so it cannot "
                "take part in their step")
        serving.serve_joined_step()
    # a barrier needs nothing more than the exchange


def _neutral(words: list[int], rt: topology.Runtime) -> torch.Tensor:
    """The tensor a joined rank adds to an allreduce: one that leaves the result alone."""
    dtype = getattr(torch, signature.name_of(words[DTYPE]))
    on_gpu = signature.name_of(words[DEVICE]) != "cpu"
    where = rt.device if on_gpu else torch.device("cpu")
    shape = words[DIMS][:words[NDIM]]
    op = ReduceOp[signature.name_of(words[OP])]
    if op is Product:
        return torch.ones(shape, dtype=dtype, device=where)
    if op in (Min, Max) and dtype == torch.bool:
        return torch.full(shape, op is Min, dtype=dtype, device=where)
    if op in (Min, Max):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return torch.full(shape, info.max if op is Min else info.min, dtype=dtype, device=where)
    return torch.zeros(shape, dtype=dtype, device=where)
