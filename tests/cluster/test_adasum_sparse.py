"""Adasum (``op=hvd.Adasum``) and ``sparse_allreduce_async``: the combination rule on known
vectors (pure logic), then on a real 4-rank cluster over both wires of CPU tensors."""

from __future__ import annotations

import torch
from helpers import NP, pulled, run_ok

from ipydist.torch._wire import adasum


def test_adasum_of_equal_tensors_is_their_average_and_of_orthogonal_ones_their_sum():
    a = torch.tensor([3.0, 4.0, 0.0])
    assert torch.equal(adasum.pair(a, a), a)
    b = torch.tensor([0.0, 0.0, 2.0])
    assert torch.equal(adasum.pair(a, b), a + b)
    zero = torch.zeros(3)
    assert torch.equal(adasum.pair(a, zero), a) and torch.equal(adasum.pair(zero, a), a)
    # opposite directions cancel as the rule says: (1 + 1/2) a + (1 + 1/2) (-a) = 0
    assert torch.equal(adasum.pair(a, -a), torch.zeros(3))


def test_adasum_combines_in_a_binary_tree_with_the_odd_one_moving_up():
    vs = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    expected = adasum.pair(adasum.pair(adasum.pair(vs[0], vs[1]), adasum.pair(vs[2], vs[3])),
                           vs[4])
    assert torch.equal(adasum.combine(vs), expected)
    assert torch.equal(adasum.combine(vs[:1]), vs[0])


def test_adasum_allreduce_on_the_ranks(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
from ipydist.torch._wire import adasum
r, n = hvd.rank(), hvd.size()
mine = torch.randn(3, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
every = hvd.allgather(mine[None])
combined = hvd.allreduce(mine, op=hvd.Adasum)
scaled = hvd.allreduce(mine, op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25)
same = hvd.allreduce(torch.ones(4), op=hvd.Adasum)
grouped = hvd.grouped_allreduce([mine, torch.ones(2)], op=hvd.Adasum)
h = hvd.allreduce_async(mine, op=hvd.Adasum)
async_result = hvd.synchronize(h)
errors = []
for bad in (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum),
            lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum)):
    try:
        bad()
    except (ValueError, RuntimeError) as e:
        errors.append(f"{type(e).__name__}: {e}")
expected = adasum.combine(list(every.unbind(0)))
outcome = dict(
    tree=(combined - expected).abs().max().item(),
    scaled=(scaled - expected * 0.5).abs().max().item(),
    same=same.tolist(), grouped=(grouped[0] - expected).abs().max().item(),
    grouped_ones=grouped[1].tolist(), asynchronous=(async_result - expected).abs().max().item(),
    identical=hvd.allgather(combined[None]).unique(dim=0).shape[0], errors=errors)
""")
    for outcome in pulled(shell, "outcome"):
        assert outcome["tree"] == 0.0 and outcome["grouped"] == 0.0
        assert outcome["asynchronous"] == 0.0 and outcome["scaled"] < 1e-12
        assert outcome["same"] == [1.0] * 4 and outcome["grouped_ones"] == [1.0] * 2
        assert outcome["identical"] == 1  # every rank holds the same result
        assert outcome["errors"][0].startswith("ValueError") and \
            "floating-point tensors" in outcome["errors"][0]
        # a RuntimeError, as Horovod raises (its test catches that type)
        assert outcome["errors"][1].startswith("RuntimeError") and \
            "not Adasum" in outcome["errors"][1]


def test_sparse_allreduce_async(shell, capsys, cluster, transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
# rank r has entries at rows r and n (the last row is shared by every rank)
sparse = torch.sparse_coo_tensor([[r, n], [0, 1]], [1.0 + r, 10.0], (n + 1, 2))
summed = hvd.sparse_allreduce_async(sparse, name="s", op=hvd.Sum)().coalesce()
averaged = hvd.sparse_allreduce_async(sparse, op=hvd.Average)().coalesce()
dense = hvd.allreduce(sparse.to_dense(), op=hvd.Sum)
outcome = (summed.is_sparse, torch.equal(summed.to_dense(), dense),
           torch.allclose(averaged.to_dense(), dense / n))
""")
    assert pulled(shell, "outcome") == [(True, True, True)] * NP
