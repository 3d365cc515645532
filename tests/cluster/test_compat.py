"""Code written for other tools runs in ``%%everyrank`` cells as it is: the PyTorch DDP
tutorial (its own init_process_group/destroy_process_group), DDP on the group ``%dist_start``
made, and the classic Horovod PyTorch recipe with ``import ipydist.torch as hvd``."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import NP, run_cell


def ok(shell, capsys, code: str):
    result, out, err = run_cell(shell, capsys, code)
    if result.error_in_exec is not None:
        raise AssertionError(f"cell failed: {result.error_in_exec!r}\n{out}\n{err}")
    return out, err


def push(shell, capsys, **values) -> None:
    shell.user_ns.update(values)
    ok(shell, capsys, "%dist_push " + " ".join(values))


def assert_identical_on_every_rank(states: list[dict]) -> None:
    assert len(states) == NP
    for r, state in enumerate(states[1:], start=1):
        assert state.keys() == states[0].keys()
        for k in states[0]:
            assert state[k].equal(states[0][k]), f"{k} differs between rank 0 and rank {r}"


# "Getting Started with Distributed Data Parallel" (pytorch.org/tutorials/intermediate/
# ddp_tutorial.html), demo_basic and demo_checkpoint, as written there for CPU/gloo. The only
# changes: no `.to(rank)` / `device_ids=[rank]` (CPU ranks), map_location {'cpu': 'cpu'} instead
# of the cuda mapping, CHECKPOINT_PATH in the directory the test pushes (`ckpt_dir`) instead of
# tempfile.gettempdir(), and one added line (marked) that keeps a copy of the trained weights in
# a module-level list so the test can compare ranks.
#
# The line copies the weights, so the DDP model (and, through its Reducer, the group the
# tutorial's second setup() asked for) is freed when demo_checkpoint returns. That used to
# deadlock a rank now and then (pytorch/pytorch#56297); ipydist now makes that group itself and
# keeps every group it retires alive, and this test keeps it honest.
TUTORIAL = """%%everyrank
import os
import sys
import tempfile
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ['MASTER_ADDR'] = 'localhost'
    os.environ['MASTER_PORT'] = '12355'

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model (CPU ranks: no .to(rank), no device_ids)
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


trained = []  # added for the test: demo_checkpoint appends its weights here


def demo_checkpoint(rank, world_size):
    print(f"Running DDP checkpoint example on rank {rank}.")
    setup(rank, world_size)

    model = ToyModel()
    ddp_model = DDP(model)

    CHECKPOINT_PATH = ckpt_dir + "/model.checkpoint"
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    # configure map_location properly (CPU ranks)
    map_location = {'cpu': 'cpu'}
    ddp_model.load_state_dict(
        torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)

    loss_fn(outputs, labels).backward()
    optimizer.step()
    trained.append({k: v.detach().clone() for k, v in ddp_model.state_dict().items()})  # added

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.

    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    cleanup()
    print(f"Finished running DDP checkpoint example on rank {rank}.")
"""


def test_ddp_tutorial_demos_then_ipydist_collectives(shell, capsys, cluster, tmp_path):
    push(shell, capsys, ckpt_dir=str(tmp_path))
    ok(shell, capsys, TUTORIAL)

    # mp.spawn(demo_fn, args=(world_size,), nprocs=world_size) becomes a call on every rank.
    # Seeding by rank (not in the tutorial) gives every rank other weights and other data, so
    # identical parameters afterwards show DDP's broadcast and gradient averaging at work.
    out, _ = ok(shell, capsys, """%%everyrank
torch.manual_seed(int(os.environ["RANK"]))
demo_basic(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
""")
    for r in range(NP):
        assert f"[rank {r}] Running basic DDP example on rank {r}." in out
        assert f"[rank {r}] Finished running basic DDP example on rank {r}." in out

    out, _ = ok(shell, capsys, """%%everyrank
torch.manual_seed(100 + int(os.environ["RANK"]))
demo_checkpoint(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
""")
    for r in range(NP):
        assert f"[rank {r}] Running DDP checkpoint example on rank {r}." in out
        assert f"[rank {r}] Finished running DDP checkpoint example on rank {r}." in out
    ok(shell, capsys, """%%everyrank
trained_state = trained
""")
    trained = shell.run_line_magic("dist_pull", "trained_state")
    assert [len(t) for t in trained] == [1] * NP
    assert_identical_on_every_rank([t[0] for t in trained])
    assert set(trained[0][0]) == {"module.net1.weight", "module.net1.bias",
                                  "module.net2.weight", "module.net2.bias"}
    assert not (tmp_path / "model.checkpoint").exists(), "rank 0 removes the checkpoint"

    # The tutorial destroyed the process group; ipydist's collectives make a fresh one.
    ok(shell, capsys, """%%everyrank
import ipydist.torch as hvd
destroyed = not dist.is_initialized()
total = hvd.allreduce(torch.ones(1), op=hvd.Sum)
shared = hvd.broadcast_object({"from": hvd.rank(), "note": "after the tutorial"}, root_rank=2)
after = dict(destroyed=destroyed, total=total.tolist(), shared=shared,
             initialized=dist.is_initialized(), world=dist.get_world_size(), rank=dist.get_rank())
""")
    for r, after in enumerate(shell.run_line_magic("dist_pull", "after")):
        assert after["destroyed"], "the tutorial's cleanup() destroyed the group"
        assert after["total"] == [float(NP)]
        assert after["shared"] == {"from": 2, "note": "after the tutorial"}
        assert after["initialized"] and after["world"] == NP and after["rank"] == r


def test_ddp_on_the_group_dist_start_made(shell, capsys, cluster):
    """DDP code with no init_process_group of its own trains on ipydist's group."""
    ok(shell, capsys, """%%everyrank
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)  # other weights on each rank: DDP broadcasts rank 0's
model = DDP(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(7)
w_true = torch.randn(8, 1, generator=g)
X_eval = torch.randn(256, 8, generator=g)
y_eval = X_eval @ w_true
def global_loss():
    with torch.no_grad():
        t = nn.functional.mse_loss(model(X_eval), y_eval).reshape(1)
    dist.all_reduce(t)
    return t.item() / world
first = global_loss()
for step in range(30):
    X = torch.randn(32, 8)  # this rank's own batch (seeded by rank above)
    loss = nn.functional.mse_loss(model(X), X @ w_true)
    opt.zero_grad()
    loss.backward()
    opt.step()
last = global_loss()
sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
every = [torch.zeros_like(sums) for _ in range(world)]
dist.all_gather(every, sums)
ddp = dict(world=world, rank=rank, backend=dist.get_backend(), first=first, last=last,
           identical=all(e.equal(every[0]) for e in every), sums=sums,
           state={k: v.clone() for k, v in model.state_dict().items()})
""")
    results = shell.run_line_magic("dist_pull", "ddp")
    for r, res in enumerate(results):
        assert res["world"] == NP and res["rank"] == r and res["backend"] == "gloo"
        assert res["identical"], "allgathered checksums differ between ranks"
        assert res["last"] < 0.5 * res["first"], (res["first"], res["last"])
        assert res["sums"].equal(results[0]["sums"])
    assert_identical_on_every_rank([res["state"] for res in results])


HOROVOD = """%%everyrank
import os
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
import ipydist.torch as hvd

epochs, batch_size, log_interval = {epochs}, 16, 4

# Horovod: initialize library.
hvd.init()
torch.manual_seed(42)

if torch.cuda.is_available():
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

# A linearly separable two-class problem (the same on every rank: seeded above).
X = torch.randn(512, 2)
y = (X[:, 0] - 0.5 * X[:, 1] > 0.1).long()
train_set = torch.utils.data.TensorDataset(X, y)

# Horovod: use DistributedSampler to partition the training data.
train_sampler = torch.utils.data.distributed.DistributedSampler(
    train_set, num_replicas=hvd.size(), rank=hvd.rank())
train_loader = torch.utils.data.DataLoader(
    train_set, batch_size=batch_size, sampler=train_sampler)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(2, 32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


model = Net()

# Horovod: scale learning rate by the number of GPUs.
optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def train(epoch):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in this shard.
            print('Train Epoch: {{}} [{{}}/{{}}]\\tLoss: {{:.6f}}'.format(
                epoch, batch_idx * len(data), len(train_sampler), loss.item()))


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def evaluate():
    model.eval()
    correct = 0.
    with torch.no_grad():
        for data, target in train_loader:
            correct += model(data).argmax(dim=1).eq(target).sum().item()
    # Horovod: average metric values across workers.
    return metric_average(correct / len(train_sampler), 'avg_accuracy')


for epoch in range(1, epochs + 1):
    train(epoch)
    accuracy = evaluate()
    # Horovod: save checkpoints only on the first worker.
    if hvd.rank() == 0:
        print('Epoch {{}}: train accuracy {{:.3f}}'.format(epoch, accuracy))
        torch.save({{'epoch': epoch, 'model': model.state_dict(),
                    'optimizer': optimizer.state_dict()}}, ckpt_dir + '/checkpoint.pth.tar')

final = dict(accuracy=accuracy, state={{k: v.clone() for k, v in model.state_dict().items()}},
             shard=list(train_sampler))
"""


def test_horovod_recipe_runs_unchanged(shell, capsys, cluster, tmp_path):
    epochs = 4
    push(shell, capsys, ckpt_dir=str(tmp_path))
    out, _ = ok(shell, capsys, HOROVOD.format(epochs=epochs))

    # Logging guarded by `hvd.rank() == 0`: rank 0's lines only, tagged as rank 0's.
    lines = [line for line in out.splitlines() if "Epoch" in line]
    assert lines and all(line.startswith("[rank 0] ") for line in lines), out
    steps = 512 // NP // 16
    logged_per_epoch = len(range(0, steps, 4))
    assert sum("] Train Epoch: " in line for line in lines) == epochs * logged_per_epoch
    assert [line.split(":")[0] for line in lines if "train accuracy" in line] == [
        f"[rank 0] Epoch {e}" for e in range(1, epochs + 1)
    ]

    finals = shell.run_line_magic("dist_pull", "final")
    assert_identical_on_every_rank([f["state"] for f in finals])
    for f in finals:
        assert f["accuracy"] == pytest.approx(finals[0]["accuracy"])
        assert f["accuracy"] >= 0.9, f["accuracy"]
    shards = [f["shard"] for f in finals]
    assert sorted(i for s in shards for i in s) == list(range(512)), "shards cover the set"

    # torch.save guarded by `hvd.rank() == 0`: one checkpoint, rank 0's last epoch.
    assert os.listdir(tmp_path) == ["checkpoint.pth.tar"]
    saved = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)
    assert saved["epoch"] == epochs
    assert saved["model"].keys() == finals[0]["state"].keys()
    assert all(saved["model"][k].equal(v) for k, v in finals[0]["state"].items())
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01 * NP)
