"""Horovod's DistributedOptimizer details on a real 4-rank cluster: optimizer state broadcast
before the first step, and the warning for a step that synchronizes again."""

from __future__ import annotations

from helpers import pulled, run_ok


def test_broadcast_optimizer_state_before_any_step_creates_the_state(shell, capsys, cluster):
    """As in Horovod: a zero-gradient step creates the state (here the momentum buffers, all
    equal to rank 0's), parameters that require a gradient get a zero one, frozen ones keep
    None; unlike Horovod, the parameters are left as they were (weight decay would move
    them)."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
torch.manual_seed(hvd.rank())
frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
w = torch.nn.Parameter(torch.randn(4))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD([frozen, w], lr=0.1, momentum=0.9, weight_decay=0.5, nesterov=True),
    named_parameters=[("frozen", frozen), ("w", w)])
before = w.detach().clone()
hvd.broadcast_optimizer_state(opt, root_rank=0)
buffer = opt.state[w]["momentum_buffer"]
lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.ones(2))])  # its step needs a closure
hvd.broadcast_optimizer_state(lbfgs, root_rank=0)
outcome = (frozen.grad is None, w.grad.tolist(), torch.equal(w.detach(), before),
           buffer.tolist(), hvd.broadcast(buffer, 0).tolist(), len(lbfgs.state))
""")
    outcomes = pulled(shell, "outcome")
    for frozen_none, grad, unchanged, buffer, roots, lbfgs_states in outcomes:
        assert lbfgs_states == 0  # no step taken for it: its first real step makes the state
        assert frozen_none and grad == [0.0] * 4 and unchanged
        assert buffer == roots  # every rank holds rank 0's state
        assert any(v != 0.0 for v in buffer)  # weight decay's term: a real step ran


def test_step_after_synchronize_warns_as_horovod_does(shell, capsys, cluster):
    run_ok(shell, capsys, """%%everyrank
import warnings, torch, ipydist.torch as hvd
m = torch.nn.Linear(2, 1)
hvd.broadcast_parameters(m.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                               named_parameters=m.named_parameters())
counts = []
for explicit, skip in ((True, False), (True, True), (False, False)):
    opt.zero_grad()
    m(torch.ones(1, 2)).sum().backward()
    if explicit:
        opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if skip:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    counts.append(sum("without optimizer.skip_synchronize()" in str(w.message)
                      for w in caught))
""")
    for counts in pulled(shell, "counts"):
        assert counts == [1, 0, 0]


def test_process_set_sparse_gradients_and_explicit_groups(shell, capsys, cluster, transport):
    """DistributedOptimizer among a process set (its ranks average; the others make it too,
    as Horovod lets them, and train alone), a sparse embedding's gradient averaged and handed
    back sparse (with sparse_as_dense too, as current Horovod does: SparseAdam needs it),
    Horovod's ``_parameter_names``, and its num_groups and groups fusing the buckets."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = hvd.rank()
pair = hvd.add_process_set([0, 1])
w = torch.nn.Parameter(torch.zeros(2))
opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)],
                               process_set=pair)
opt.zero_grad()
(w * (r + 1)).sum().backward()
opt.synchronize()
with opt.skip_synchronize():
    opt.step()
paired = w.tolist()
names = sorted(opt._parameter_names.values())
kinds = []
for dense in (False, True):
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.zeros_(emb.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=emb.named_parameters(),
                                   sparse_as_dense=dense)
    opt.zero_grad()
    emb(torch.tensor([r])).sum().backward()   # rank r's gradient: ones in row r
    opt.synchronize()
    kinds.append(emb.weight.grad.is_sparse)
    with opt.skip_synchronize():
        opt.step()
    rows = emb.weight.detach()[:, 0].tolist()
layers = [torch.nn.Linear(4, 4) for _ in range(4)]
params = [p for layer in layers for p in layer.parameters()]
by_count = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), num_groups=2)
by_list = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   groups=[list(layers[0].parameters()), [layers[3].weight]])
buckets = (len(by_count._buckets), [len(b.params) for b in by_list._buckets])
try:
    hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), groups=[[torch.zeros(1)]])
    bad = None
except ValueError as e:
    bad = str(e)
hvd.remove_process_set(pair)
""")
    n = 4
    for rank, (paired, names, kinds, rows, buckets, bad) in enumerate(zip(
            pulled(shell, "paired"), pulled(shell, "names"), pulled(shell, "kinds"),
            pulled(shell, "rows"), pulled(shell, "buckets"), pulled(shell, "bad"))):
        assert paired == ([-1.5, -1.5] if rank in (0, 1) else [-(rank + 1.0)] * 2)
        assert names == (["w"] if rank in (0, 1) else [])
        assert kinds == [True, True]
        assert rows == [-1.0 / n] * n + [0.0, 0.0]  # each row: one rank's 1, averaged
        assert buckets[0] == 2
        assert sorted(buckets[1]) == [1, 2, 5]  # layer 0's two, layer 3's weight, the rest
        assert "not a parameter of this optimizer" in bad
