"""CNTK's distributed learners on a real 4-rank cluster: 1-bit SGD's warm start
(``distributed_after``), block momentum (BMUF), and checkpoints of what differs per rank."""

from __future__ import annotations

import pytest
from helpers import NP, as_merged, run_cell

from ipydist.errors import CellTimeout

SETUP = """%%everyrank
import torch, ipydist.torch as hvd
N, r, b = hvd.size(), hvd.rank(), 16
torch.manual_seed(0)
X = torch.randn(4000, 20)
Y = X @ torch.randn(20, 1) + 0.1 * torch.randn(4000, 1)
def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
def batch(step):
    lo = (step * N * b) % (len(X) - N * b) + r * b
    return X[lo:lo + b], Y[lo:lo + b]
def local_step(model, opt, step):
    x, y = batch(step)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
def same_everywhere(t):
    return bool(hvd.allreduce(t, op=hvd.Max).equal(hvd.allreduce(t, op=hvd.Min)))
def full_loss(model):
    with torch.no_grad():
        return ((model(X) - Y) ** 2).mean().item()
def resumes_exactly(fresh, path, saved_at, until, differs):
    # Train a fresh (model, optimizer) to step saved_at, save a checkpoint there and go on to
    # until; then a fresh pair loaded from the file goes on to until. Returns whether
    # differs(model, opt) held at the save, whether both runs ended bit-equal, and whether the
    # ranks are identical.
    model, opt = fresh()
    for step in range(saved_at):
        local_step(model, opt, step)
    hvd.save_checkpoint(path, model=model, optimizer=opt)
    differed = differs(model, opt)
    for step in range(saved_at, until):
        local_step(model, opt, step)
    straight = flat(model)
    model, opt = fresh()
    ck = hvd.load_checkpoint(path)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    for step in range(saved_at, until):
        local_step(model, opt, step)
    return differed, flat(model).equal(straight), same_everywhere(flat(model))
"""


def run_ok(shell, capsys, code):
    result, out, err = run_cell(shell, capsys, code)
    if result.error_in_exec is not None:
        raise AssertionError(f"{result.error_in_exec!r}\n{out}\n{err}")
    return out, err


def stall_one_step(shell, capsys, step: int) -> None:
    """The last rank sleeps in training step ``step`` while the others wait for it in the
    exchange: the cell's --timeout of 2 s ends it (the test has set a short failure_grace)."""
    result, _, err = run_cell(shell, capsys, f"""%%everyrank --timeout 2
import time
x, y = batch({step})
opt.zero_grad()
((model(x) - y) ** 2).mean().backward()
if hvd.rank() == {NP - 1}:
    time.sleep(60)  # the others wait for it in the exchange
opt.step()
""")
    assert isinstance(result.error_in_exec, CellTimeout), (result.error_in_exec, err)


@pytest.fixture
def learners(shell, capsys, cluster):
    run_ok(shell, capsys, SETUP)
    return cluster


def test_warm_start_averages_in_full_precision_then_switches_to_onebit(
        shell, capsys, learners, transport):
    """``distributed_after=3``: the first 3 steps are exactly full-precision averaging (bit for
    bit the same parameters as Compression.none), the 1-bit exchange and its residual start at
    step 4, and the ranks stay identical throughout."""
    run_ok(shell, capsys, """%%everyrank
def run(compression, after, steps=8):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   compression=compression, distributed_after=after,
                                   bucket_cap_mb=0.0001)
    seen = []
    for step in range(steps):
        local_step(model, opt, step)
        seen.append((flat(model), opt._buckets[0].kept is not None,
                     same_everywhere(flat(model))))
    return seen
warm = run(hvd.Compression.onebit, 3)
full = run(hvd.Compression.none, 0)
outcome = ([w[0].equal(f[0]) for w, f in zip(warm, full)], [w[1] for w in warm],
           all(w[2] for w in warm))
""")
    for equal_to_full, has_residual, identical in shell.run_line_magic("dist_pull", "outcome"):
        assert equal_to_full[:3] == [True] * 3, "warm-start steps are full precision"
        assert not any(equal_to_full[3:]), "1-bit steps after the warm start"
        assert has_residual == [False] * 3 + [True] * 5
        assert identical


def test_onebit_residuals_are_checkpointed_per_rank(shell, capsys, learners, transport,
                                                    tmp_path):
    """The residuals differ between ranks, so ``save_checkpoint`` keeps each rank's own, and a
    fresh model and optimizer loaded from the file go on bit for bit as the saved ones did."""
    path = str(tmp_path / "onebit.pt")
    run_ok(shell, capsys, f"""%%everyrank
def fresh():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   compression=hvd.Compression.onebit, distributed_after=2)
    return model, opt
outcome = resumes_exactly(fresh, {path!r}, 5, 9,
                          lambda model, opt: not same_everywhere(opt._buckets[0].kept.residual))
""")
    for residual_differs, resumed_equal, identical in shell.run_line_magic("dist_pull",
                                                                          "outcome"):
        assert residual_differs, "each rank keeps its own residual"
        assert resumed_equal, "resumed training differs from training straight on"
        assert identical


def test_block_momentum_zero_with_blocks_of_one_step_is_model_averaging(
        shell, capsys, learners, transport):
    """BMUF with block_momentum=0, block_learning_rate=1 and blocks of one step is synchronous
    training by averaging the models after every local step."""
    run_ok(shell, capsys, """%%everyrank
model, ref = make_model(), make_model()
opt = hvd.BlockMomentum(torch.optim.SGD(model.parameters(), lr=0.05), block_steps=1,
                        block_momentum=0.0)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
identical = []
for step in range(6):
    local_step(model, opt, step)
    local_step(ref, ref_opt, step)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(hvd.allreduce(p, op=hvd.Average))
    identical.append(same_everywhere(flat(model)))
outcome = (all(identical), (flat(model) - flat(ref)).abs().max().item())
""")
    for identical, maxdiff in shell.run_line_magic("dist_pull", "outcome"):
        assert identical
        assert maxdiff < 1e-6, maxdiff


def test_block_momentum_syncs_every_block_and_learns(shell, capsys, learners, transport):
    """Blocks given in CNTK's samples (block_size over all ranks, batch_size per rank) are 4
    steps. Within a block each rank trains its own model (they differ); at every block's end they
    are bit-identical; with the default block momentum (1 - 1/size) and Nesterov look-ahead it
    fits the regression about as well as synchronous SGD after the same number of samples."""
    run_ok(shell, capsys, """%%everyrank
model = make_model()
start_loss = full_loss(model)
# CNTK's way: 4 batches of b samples on each of the N ranks per block
opt = hvd.BlockMomentum(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                        block_size=4 * N * b, batch_size=b)
after_block, within_block = [], []
for step in range(40):
    local_step(model, opt, step)
    (after_block if (step + 1) % 4 == 0 else within_block).append(same_everywhere(flat(model)))
bmuf_loss = full_loss(model)
sync = make_model()
sync_opt = hvd.DistributedOptimizer(torch.optim.SGD(sync.parameters(), lr=0.05, momentum=0.9))
for step in range(40):
    local_step(sync, sync_opt, step)
outcome = (all(after_block), any(within_block), opt.block_momentum, start_loss, bmuf_loss,
           full_loss(sync), opt.block_steps)
""")
    for after, within, momentum, start, bmuf_loss, sync_loss, steps in shell.run_line_magic(
            "dist_pull", "outcome"):
        assert steps == 4, "block_size counts samples over all ranks"
        assert after, "ranks differ after a block"
        assert not within, "local models are the same within a block: nothing trained locally"
        assert momentum == pytest.approx(1 - 1 / NP)
        assert bmuf_loss < start / 4 and bmuf_loss < 1.5 * sync_loss, (start, bmuf_loss, sync_loss)


def test_block_momentum_checkpoint_mid_block_resumes_bit_identically(
        shell, capsys, learners, tmp_path):
    """Saved 2 steps into a block of 3 with Adam as the local optimizer (its state differs per
    rank): a fresh model and optimizer loaded from the file go on exactly as the saved ones."""
    path = str(tmp_path / "bmuf.pt")
    run_ok(shell, capsys, f"""%%everyrank
def fresh():
    model = make_model()
    return model, hvd.BlockMomentum(torch.optim.Adam(model.parameters(), lr=0.01), block_steps=3)
outcome = resumes_exactly(fresh, {path!r}, 5, 12,
                          lambda model, opt: not same_everywhere(flat(model)))
""")
    for differs, resumed_equal, identical in shell.run_line_magic("dist_pull", "outcome"):
        assert differs, "the checkpoint was taken within a block"
        assert resumed_equal, "resumed training differs from training straight on"
        assert identical


@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "cpu-hogs"])
def test_block_momentum_interrupted_mid_block_goes_on_consistently(shell, capsys, learners,
                                                                   request, loaded):
    """A cell stopped while one rank is still in its block and the others wait in the block's
    average: the recovery copies rank 0's model, optimizer and block state to every rank (so
    they are bit-identical and agree where the block stands), and the next blocks go on; on a
    loaded machine too, where the ranks reach the block's average at different times."""
    if loaded:
        request.getfixturevalue("hogs")
    saved = learners.options
    learners.options = saved.changed(failure_grace=1.0)
    try:
        run_ok(shell, capsys, """%%everyrank
import time
model = make_model()
opt = hvd.BlockMomentum(torch.optim.SGD(model.parameters(), lr=0.05), block_steps=4)
for step in range(6):
    local_step(model, opt, step)
""")
        result, _, err = run_cell(shell, capsys, f"""%%everyrank --timeout 2
for step in range(6, 100):
    local_step(model, opt, step)
    if hvd.rank() == {NP - 1} and step == 7:
        time.sleep(60)  # the others wait for it in the block's average
""")
        assert isinstance(result.error_in_exec, CellTimeout), (result.error_in_exec, err)
        out, _ = run_ok(shell, capsys, """%%everyrank
print("after the recovery: block steps agree:", same_everywhere(opt._steps_in_block),
      "same model:", same_everywhere(flat(model)))
for step in range(9):
    local_step(model, opt, step)
opt.synchronize()
print("after the next blocks:", same_everywhere(flat(model)))
""")
        out = as_merged(out)
        assert "[all ranks] after the recovery: block steps agree: True same model: True" in out
        assert "[all ranks] after the next blocks: True" in out, out
    finally:
        learners.options = saved


def test_onebit_training_goes_on_after_an_interrupted_exchange(shell, capsys, learners,
                                                              transport):
    """The others wait in the 1-bit exchange for a rank that sleeps: the timeout ends the
    cell, the abandoned step leaves every residual as the last completed step left it, and
    training goes on with identical ranks."""
    saved = learners.options
    learners.options = saved.changed(failure_grace=1.0)
    try:
        run_ok(shell, capsys, """%%everyrank
import time
model = make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               compression=hvd.Compression.onebit)
for step in range(3):
    local_step(model, opt, step)
kept = opt._buckets[0].kept.residual.clone()
""")
        stall_one_step(shell, capsys, 3)
        out, _ = run_ok(shell, capsys, """%%everyrank
print("residual kept:", opt._buckets[0].kept.residual.equal(kept))
for step in range(3, 8):
    local_step(model, opt, step)
print("same model:", same_everywhere(flat(model)))
""")
        assert "[all ranks] residual kept: True" in as_merged(out), out
        assert "[all ranks] same model: True" in as_merged(out), out
    finally:
        learners.options = saved


def test_powersgd_is_exact_on_low_rank_sums_warm_starts_and_keeps_the_ranks_identical(
        shell, capsys, learners, transport):
    """PowerSGD between real ranks, on both wires: a batch of one per rank makes a layer's
    summed gradient of rank 4, which rank 4 carries exactly (the bias whole, in full precision), in
    a fifth of fp32's bytes; in training, ``start_iter=3`` steps are fp32's bit for bit, then
    the exchange starts, the ranks stay identical, and the loss ends near fp32's."""
    run_ok(shell, capsys, """%%everyrank
def low_rank_sum():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(N, 64)[r:r + 1]
    sent = {}
    for name, compression in (("fp32", hvd.Compression.none),
                              ("powersgd", hvd.Compression.powersgd(rank=4, start_iter=0))):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                       compression=compression, op=hvd.Sum)
        opt.zero_grad()
        lin(x).pow(2).sum().backward()
        local = [p.grad.clone() for p in lin.parameters()]
        opt.synchronize()
        sent[name] = opt.bytes_sent
    exact = [hvd.allreduce(g, op=hvd.Sum) for g in local]
    weight, bias = [p.grad for p in lin.parameters()]
    # the bias travels whole; gloo's ring may sum it in another order than a lone allreduce
    return (torch.allclose(weight, exact[0], rtol=1e-4, atol=1e-5),
            torch.allclose(bias, exact[1], rtol=1e-6, atol=1e-7),
            sent["fp32"] / sent["powersgd"])

def train(compression, steps=40):
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   compression=compression)
    seen = []
    for step in range(steps):
        local_step(model, opt, step)
        seen.append((flat(model), opt._buckets[0].kept is not None,
                     same_everywhere(flat(model))))
    return seen, full_loss(model)
psgd, psgd_loss = train(hvd.Compression.powersgd(rank=2, start_iter=3))
full, full_loss_ = train(hvd.Compression.none)
outcome = (low_rank_sum(), [p[0].equal(f[0]) for p, f in zip(psgd, full)],
           [p[1] for p in psgd], all(p[2] for p in psgd), psgd_loss, full_loss_)
""")
    for exact, equal_to_full, kept, identical, loss, fp32_loss in shell.run_line_magic(
            "dist_pull", "outcome"):
        weight_exact, bias_exact, fewer = exact
        assert weight_exact and bias_exact and fewer > 4.5, exact
        assert equal_to_full[:3] == [True] * 3, "start_iter's steps are full precision"
        assert not any(equal_to_full[3:]), "PowerSGD steps after them"
        assert kept == [False] * 3 + [True] * 37
        assert identical
        assert loss < 1.5 * fp32_loss + 0.02, (loss, fp32_loss)


def test_powersgd_state_is_checkpointed_per_rank_and_dropped_alike_after_a_release(
        shell, capsys, learners, tmp_path):
    """The error feedback differs between ranks (a checkpoint keeps each rank's own and Q,
    and a fresh pair resumes bit for bit); a step the others wait in for a sleeping rank is
    ended by the timeout, every rank drops Q (the abandoned step may have left the ranks'
    copies apart) and keeps its error feedback, and training goes on with identical ranks."""
    path = str(tmp_path / "powersgd.pt")
    run_ok(shell, capsys, f"""%%everyrank
def fresh():
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   compression=hvd.Compression.powersgd(rank=2, start_iter=2))
    return model, opt
outcome = resumes_exactly(fresh, {path!r}, 5, 9,
                          lambda model, opt: not same_everywhere(opt._buckets[0].kept.error))
model, opt = fresh()
for step in range(4):
    local_step(model, opt, step)
error = opt._buckets[0].kept.error.clone()
""")
    for error_differs, resumed_equal, identical in shell.run_line_magic("dist_pull", "outcome"):
        assert error_differs, "each rank keeps its own error feedback"
        assert resumed_equal, "resumed training differs from training straight on"
        assert identical
    saved = learners.options
    learners.options = saved.changed(failure_grace=1.0)
    try:
        stall_one_step(shell, capsys, 4)
        out, _ = run_ok(shell, capsys, """%%everyrank
kept = opt._buckets[0].kept
print("q dropped, error kept:", kept.q is None, kept.error.equal(error))
for step in range(4, 9):
    local_step(model, opt, step)
print("same model:", same_everywhere(flat(model)), same_everywhere(kept.q))
""")
        assert "[all ranks] q dropped, error kept: True True" in as_merged(out), out
        assert "[all ranks] same model: True True" in as_merged(out), out
    finally:
        learners.options = saved


def test_bad_learner_arguments_say_what_to_do(shell, capsys, learners):
    run_ok(shell, capsys, """%%everyrank
errors = []
for make in (
    lambda: hvd.BlockMomentum(torch.optim.SGD(make_model().parameters(), lr=0.1), block_size=64),
    lambda: hvd.BlockMomentum(torch.optim.SGD(make_model().parameters(), lr=0.1), block_steps=2,
                              block_momentum=1.0),
    lambda: hvd.BlockMomentum(hvd.DistributedOptimizer(
        torch.optim.SGD(make_model().parameters(), lr=0.1)), block_steps=2),
    lambda: hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                     distributed_after=-1),
    lambda: hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                                     compression=hvd.Compression.powersgd),
):
    try:
        make()
    except (ValueError, TypeError) as e:
        errors.append(str(e))
""")
    for errors in shell.run_line_magic("dist_pull", "errors"):
        assert len(errors) == 5, errors
        assert "block_size=64 counts samples, as CNTK's block_size does" in errors[0]
        assert "block_momentum must be in [0, 1)" in errors[1]
        assert "not a DistributedOptimizer" in errors[2]
        assert "distributed_after must be a number of steps" in errors[3]
        assert "Compression.powersgd takes its rank: call it" in errors[4]
    run_ok(shell, capsys, """%%everyrank
pair = hvd.add_process_set([0, 1])
try:
    hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                             compression=hvd.Compression.powersgd(rank=2), process_set=pair)
    refused = None
except ValueError as e:
    refused = str(e)
hvd.remove_process_set(pair)
""")
    refused = shell.run_line_magic("dist_pull", "refused")
    assert refused[2:] == [None] * (NP - 2), "outside the set: nothing to average, as Horovod"
    assert refused[:2] == ["Compression.powersgd(rank=2, start_iter=10, min_compression_rate=2) "
                           "averages over every rank: it takes no process_set"] * 2, refused


def test_load_from_a_different_number_of_ranks_warns_and_starts_residuals_afresh(
        shell, capsys, learners):
    result, out, err = run_cell(shell, capsys, """%%everyrank
import warnings
model = make_model()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               compression=hvd.Compression.onebit)
local_step(model, opt, 0)
state = opt.state_dict()
state["ipydist_rank_state"] = [{"onebit": [None]}] * (N + 1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.load_state_dict(state)
print([str(w.message) for w in caught], opt._buckets[0].kept is None)
""")
    assert result.error_in_exec is None, err
    assert f"written by {NP + 1} ranks and this run has {NP}" in out, out
    assert 'start afresh"] True' in out, out



DIGITS_MLP = """%%everyrank
import statistics, torch, ipydist.torch as hvd
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
d = load_digits()
X, y = torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)
Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=0)
train_set = torch.utils.data.TensorDataset(Xtr, ytr)

def digits_mlp(compression, momentum, seed, epochs=30, lr=0.1, warm_epochs=1):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 10))
    sampler = hvd.shard(train_set, shuffle=True, seed=seed)
    steps_per_epoch = -(-len(sampler) // 32)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum),
                                   compression=compression,
                                   distributed_after=warm_epochs * steps_per_epoch)
    loader = torch.utils.data.DataLoader(train_set, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    identical = bool(hvd.allreduce(w, op=hvd.Max).equal(hvd.allreduce(w, op=hvd.Min)))
    with torch.no_grad():
        return (net(Xte).argmax(1) == yte).float().mean().item(), identical
"""


# about 65 s on 2 cores; 5 minutes with OMP_NUM_THREADS=2 (4 ranks of 2 threads on 2 cores)
@pytest.mark.timeout(900)
def test_onebit_with_momentum_trains_as_well_as_full_precision(shell, capsys, cluster):
    """Issue 27's bar on real ranks: 1-bit with SGD's momentum 0.9 at full precision's learning
    rate, after CNTK's warm start of one epoch, ends within 1 point of full precision on the
    digits MLP (mean of 3 seeds; the seeds' spread, about 0.4 points, makes the mean's about
    0.25, so the bar is 4 of those from where both land); plain SGD keeps working too; the
    ranks stay identical. (Without the warm start, 6 seeds under torch's AVX2 kernels ended
    1.4 points below.)"""
    run_ok(shell, capsys, DIGITS_MLP)
    run_ok(shell, capsys, """%%everyrank
runs = {(name, momentum): [digits_mlp(compression, momentum, seed) for seed in range(3)]
        for name, compression in [("fp32", hvd.Compression.none),
                                  ("1-bit", hvd.Compression.onebit)]
        for momentum in (0.9, 0.0)}
outcome = {key: ([acc for acc, _ in v], all(same for _, same in v)) for key, v in runs.items()}
""")
    outcome = shell.run_line_magic("dist_pull", "outcome --rank 0")
    mean = {key: sum(accs) / len(accs) for key, (accs, _) in outcome.items()}
    report = {key: [round(a, 4) for a in accs] for key, (accs, _) in outcome.items()}
    print("digits MLP, 4 ranks, test accuracy of 3 seeds:", report)  # shown with -s
    assert all(same for _, same in outcome.values()), report
    assert mean["fp32", 0.9] >= 0.95, report
    assert mean["1-bit", 0.9] >= mean["fp32", 0.9] - 0.01, report
    assert mean["1-bit", 0.0] >= mean["fp32", 0.0] - 0.01, report
