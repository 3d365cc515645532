"""``hvd.SyncBatchNorm`` on a real 4-rank cluster, both wires (MPI and gloo): outputs,
input and parameter gradients and running statistics match one process's
``torch.nn.BatchNorm`` on the union of the ranks' batches (of different sizes)."""

from __future__ import annotations

from helpers import pulled, run_ok


def test_matches_one_batch_norm_on_the_union_of_the_batches(shell, capsys, cluster,
                                                            transport):
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
torch.manual_seed(0)
batches = [torch.randn(2 + k, 3, 4, 5, dtype=torch.float64) * (k + 1) + k for k in range(n)]
checks = {}
for momentum in (0.1, None):
    sync = hvd.SyncBatchNorm(3, momentum=momentum).double()
    plain = torch.nn.BatchNorm2d(3, momentum=momentum).double()
    with torch.no_grad():
        for bn in (sync, plain):
            bn.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
            bn.bias.copy_(torch.tensor([0.1, 0.0, 3.0]))
    mine = batches[r].clone().requires_grad_()
    union = torch.cat(batches).requires_grad_()
    scale = torch.arange(union.numel(), dtype=torch.float64).reshape(union.shape).sin()
    start = sum(len(b) for b in batches[:r])
    rows = slice(start, start + len(batches[r]))
    for _ in range(2):  # twice: the running statistics move on
        out = sync(mine)
        (out * scale[rows]).sum().backward()
        expected = plain(union)
        (expected * scale).sum().backward()
    sync.eval(), plain.eval()
    evaluated = (sync(batches[r]) - plain(batches[r])).abs().max().item()
    checks[str(momentum)] = dict(
        out=(out - expected[rows]).abs().max().item(),
        input_grad=(mine.grad - union.grad[rows]).abs().max().item(),
        # the parameters' gradients here are this rank's share: summed over the ranks they
        # are one process's (DistributedOptimizer averages them, divided by size())
        weight_grad=(hvd.allreduce(sync.weight.grad, op=hvd.Sum) - plain.weight.grad)
        .abs().max().item(),
        bias_grad=(hvd.allreduce(sync.bias.grad, op=hvd.Sum) - plain.bias.grad)
        .abs().max().item(),
        running=max((sync.running_mean - plain.running_mean).abs().max().item(),
                    (sync.running_var - plain.running_var).abs().max().item()),
        evaluated=evaluated, tracked=int(sync.num_batches_tracked))
try:
    hvd.SyncBatchNorm(3)(torch.ones(3))
    bad = None
except ValueError as e:
    bad = str(e)
""")
    for checks, bad in zip(pulled(shell, "checks"), pulled(shell, "bad")):
        for momentum, found in checks.items():
            assert found.pop("tracked") == 2
            for what, error in found.items():
                assert error < 1e-10, (momentum, what, error)
        assert bad and "2 or more dimensions" in bad


def test_half_inputs_an_empty_rank_and_what_backward_keeps(shell, capsys, cluster):
    """bfloat16 and float16 inputs (statistics in float32, no float32 copy kept), a rank with
    no samples, and a backward that keeps the input and a few numbers per channel only
    (autograd through the merge kept several activation-sized tensors)."""
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r, n = hvd.rank(), hvd.size()
torch.manual_seed(1)
# rank 0 has no samples
batches = [torch.randn(3 * k, 4, 6, 6, dtype=torch.float64) * 2 + 1 for k in range(n)]
half_checks = {}
for dtype in (torch.bfloat16, torch.float16):
    sync = hvd.SyncBatchNorm(4)
    plain = torch.nn.BatchNorm2d(4).double()
    mine = batches[r].to(dtype).requires_grad_()
    union = torch.cat(batches).to(dtype).double().requires_grad_()
    saved = []
    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sync(mine)
    out.double().sum().backward()
    expected = plain(union)
    expected.sum().backward()
    start = sum(len(b) for b in batches[:r])
    rows = slice(start, start + len(batches[r]))
    half_checks[str(dtype)] = dict(
        dtype=str(out.dtype),
        out=(out.double() - expected[rows]).abs().max().item() if len(mine) else 0.0,
        grad=(mine.grad.double() - union.grad[rows]).abs().max().item() if len(mine) else 0.0,
        running=(sync.running_mean.double() - plain.running_mean).abs().max().item(),
        saved=sum(saved), input_bytes=mine.numel() * mine.element_size())
""")
    for checks in pulled(shell, "half_checks"):
        for dtype, found in checks.items():
            assert found["dtype"] == dtype, found
            assert found["out"] < 0.05 and found["grad"] < 0.05, (dtype, found)
            assert found["running"] < 1e-3, (dtype, found)
            # the input, its weight, and a few numbers per channel (4 channels, 4 ranks)
            assert found["input_bytes"] <= found["saved"] <= found["input_bytes"] + 512, (
                dtype, found)
