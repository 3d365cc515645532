"""``hvd.join()``: a rank that has run out of data waits for the others, taking part in their
allreduces with a neutral tensor meanwhile, as Horovod's joined ranks do.

Data that does not divide evenly gives some ranks one batch fewer. In Horovod such a rank
calls ``hvd.join()`` and the others train on: each of their allreduces gets zeros from it
(still divided by the full ``size()`` for Average), and ``join()`` returns on every rank once
all have called it, with the rank that joined last.

ipydist learns what the others are doing from the check every collective makes first
(:mod:`ipydist.torch.agreement`): a joined rank sends a "join" header in each exchange,
reads the others' headers, and posts the matching allreduce with a neutral tensor (zeros for
Sum and Average, ones for Product, the dtype's extremes for Min and Max: Horovod's zeros
would corrupt those), or the step of the DistributedOptimizer whose buckets they announce
with no gradients. Anything else the others call raises on each of them (the joined rank sits
it out), so nothing hangs. The check must be on (it is by default).
"""

from __future__ import annotations

import torch

from ipydist.rank.sampler import waits_for_peers
from ipydist.torch import agreement, optimizer, runtime, signature
from ipydist.torch.reduce_ops import Max, Min, Product, ReduceOp
from ipydist.torch.signature import CARRIED, DEVICE, DIMS, DTYPE, KIND, NDIM, OP, from_bits
from ipydist.torch.starts import start_allreduce

for _op in ReduceOp:  # so that the ops the others name can be read back
    signature.code(_op.name)


@waits_for_peers("join")
def join(device: int = -1) -> int:
    """Wait until every rank has called ``join()``, serving the others' allreduces and
    DistributedOptimizer steps with neutral values meanwhile (collective: every rank calls it
    once it has no more data). Returns the rank that joined last, the same on every rank.
    ``device`` is Horovod's; the rank's own device is used."""
    rt = runtime.ensure_process_group()
    if rt.size == 1:
        return rt.rank
    if not agreement.enabled():
        raise RuntimeError(
            "hvd.join() learns what the other ranks call from the collective check, which is "
            "off: turn it on on every rank (ipydist.torch.agreement.set_enabled(True), or "
            "leave IPYDIST_CHECK_COLLECTIVES unset)")
    first = True
    while True:
        headers = agreement.exchange_joined(first)
        first = False
        if all(h[KIND] == signature.JOIN for h in headers):
            # those whose first join header this is joined last
            return max(r for r, h in enumerate(headers) if h[CARRIED])
        if signature.disagreement(headers) is not None:
            continue  # the others raise; this rank waits for their next call
        _serve(next(h for h in headers if h[KIND] != signature.JOIN), rt)


def _serve(words: list[int], rt: runtime.Runtime) -> None:
    kind = signature.KINDS[words[KIND] - 1]
    if kind == "allreduce":
        start_allreduce(_neutral(words, rt), ReduceOp[signature.name_of(words[OP])],
                        from_bits(words[signature.PRESCALE]),
                        from_bits(words[signature.POSTSCALE]), checked=True).wait()
    elif kind == "optimizer step":
        serving = next((opt for opt in optimizer.live() if opt._serves(words)), None)
        if serving is None:
            raise RuntimeError(
                "hvd.join(): the other ranks stepped a DistributedOptimizer that this rank "
                "does not have (none here has the same parameters and settings), so it cannot "
                "take part in their step")
        serving._serve_joined()
    # a barrier needs nothing more than the exchange


def _neutral(words: list[int], rt: runtime.Runtime) -> torch.Tensor:
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
