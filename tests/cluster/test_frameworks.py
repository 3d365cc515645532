"""Training code written for the frameworks people use today runs in ``%%everyrank`` cells as
it is, on the ranks ``%dist_start`` made, and keeps its state between cells: Lightning's
``Trainer(strategy="ddp")``, and FSDP2's ``fully_shard`` on a DeviceMesh, a 2-D mesh with tensor
parallel and ``torch.distributed.checkpoint``, the Hugging Face Trainer and Accelerate, and the
integrations that draw what those trainers log. The cells build on each other in file order,
as a notebook's do."""

from __future__ import annotations

import pytest
import torch
from framework_snippets import TINY_GPT
from helpers import NP, run_cell, unwrapped


@pytest.fixture(scope="module", autouse=True)
def ranks_left_as_found(shell):
    """The cells here leave trainers and DDP models on the shared cluster's ranks, which later
    modules' recoveries would mention ("wrap your DistributedDataParallel model again"): every
    name they made that is not a module is deleted afterwards."""
    yield
    magics = shell.magics_manager.registry["DistMagics"]
    if magics.session is not None and magics.session.running:
        shell.run_cell("%%everyrank\nimport gc as _gc, types as _types\n"
                       "for _name in [n for n, v in globals().items() if not n.startswith('_') "
                       "and not isinstance(v, _types.ModuleType) and n not in "
                       "('In', 'Out', 'get_ipython', 'exit', 'quit')]:\n"
                       "    del globals()[_name]\n"
                       "_gc.collect()")


def ok(shell, capsys, code: str):
    result, out, err = run_cell(shell, capsys, code)
    if result.error_in_exec is not None:
        raise AssertionError(f"cell failed: {result.error_in_exec!r}\n{out}\n{err}")
    return out, err


def assert_identical_on_every_rank(states: list[dict]) -> None:
    assert len(states) == NP
    for r, state in enumerate(states[1:], start=1):
        for k in states[0]:
            assert state[k].equal(states[0][k]), f"{k} differs between rank 0 and rank {r}"


# A LightningModule as Lightning's docs write one, and a Trainer for DDP on the CPU with one
# process per device: the ranks of this host (``devices`` as with torchrun --nproc-per-node).
LIGHTNING = f"""%%everyrank
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
data = TensorDataset(torch.randn(128, 8), torch.randn(128, 1))
model = Regression()
trainer = L.Trainer(accelerator="cpu", devices={NP}, strategy="ddp", max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, DataLoader(data, batch_size=8))
first = (trainer.world_size, trainer.global_step)
"""


def test_lightning_ddp_fits_in_one_cell_and_fits_on_in_the_next(shell, capsys, cluster):
    pytest.importorskip("lightning")
    ok(shell, capsys, LIGHTNING)
    steps = 128 // NP // 8 * 2  # the data split over the ranks, two epochs
    assert cluster.pull("first") == [(NP, steps)] * NP
    ok(shell, capsys, "%%everyrank\ntrainer.fit_loop.max_epochs = 4\n"
                      "trainer.fit(model, DataLoader(data, batch_size=8))\n"
                      "state = {k: v.detach().clone() for k, v in model.state_dict().items()}\n"
                      "steps = trainer.global_step")
    assert cluster.pull("steps") == [2 * steps] * NP, "the second fit went on from the first"
    assert_identical_on_every_rank(cluster.pull("state"))


def test_lightning_checkpoints_once_and_the_next_cell_resumes_from_the_checkpoint(shell, capsys,
                                                                                 cluster):
    """Lightning's own checkpointing (``ModelCheckpoint``, rank 0 writes) and rank-zero
    logging, then ``fit(ckpt_path=...)`` in the next cell going on from the saved step."""
    pytest.importorskip("lightning")
    out, err = ok(shell, capsys, """%%everyrank
import os, shutil, tempfile
from lightning.pytorch.callbacks import ModelCheckpoint

ckpt_dir = [tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None]
torch.distributed.broadcast_object_list(ckpt_dir, 0)
def checkpointing_trainer(epochs):
    return L.Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_epochs=epochs,
                     logger=False, default_root_dir=ckpt_dir[0], enable_progress_bar=False,
                     enable_model_summary=False,
                     callbacks=[ModelCheckpoint(dirpath=ckpt_dir[0], save_last=True)])
torch.manual_seed(0)
saving = checkpointing_trainer(1)
saving.fit(Regression(), DataLoader(data, batch_size=8))
written = sorted(os.listdir(ckpt_dir[0]))
""")
    written = cluster.pull("written")
    assert "last.ckpt" in written[0] and len(written[0]) == 2, written  # last and the best
    assert "max_epochs=1` reached" in out + err
    assert unwrapped(out + err).count("max_epochs=1` reached") == 1, "rank 0 alone"
    ok(shell, capsys, """%%everyrank
resumed_model = Regression()
resuming = checkpointing_trainer(2)
resuming.fit(resumed_model, DataLoader(data, batch_size=8),
             ckpt_path=os.path.join(ckpt_dir[0], "last.ckpt"))
steps = (saving.global_step, resuming.global_step)
state = {k: v.detach().clone() for k, v in resumed_model.state_dict().items()}
torch.distributed.barrier()
if torch.distributed.get_rank() == 0:
    shutil.rmtree(ckpt_dir[0])""")
    per_epoch = 128 // NP // 8
    assert cluster.pull("steps") == [(per_epoch, 2 * per_epoch)] * NP, "went on from epoch 1"
    assert_identical_on_every_rank(cluster.pull("state"))


def test_lightning_s_fsdp2_strategy_shards_on_the_cpu_and_fits_on_in_the_next_cell(
        shell, capsys, cluster):
    """Lightning's ``strategy="fsdp"`` (FSDP1) asks for CUDA; its ``ModelParallelStrategy``
    applies FSDP2 in ``configure_model`` and runs on the CPU ranks."""
    pytest.importorskip("lightning")
    ok(shell, capsys, f"""%%everyrank
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard


class Sharded(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def configure_model(self):  # Lightning calls it on every fit: shard once
        if isinstance(self.net, FSDPModule):
            return
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
sharded_module = Sharded()
fsdp2 = ModelParallelStrategy(data_parallel_size={NP}, tensor_parallel_size=1)
sharding = L.Trainer(accelerator="cpu", devices="auto", max_epochs=1, logger=False,
                     strategy=fsdp2, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
sharding.fit(sharded_module, DataLoader(data, batch_size=8))
shard = tuple(sharded_module.net[0].weight.to_local().shape)
""")
    assert cluster.pull("shard") == [(32 // NP, 8)] * NP, "each rank holds its shard"
    ok(shell, capsys, "%%everyrank\nsharding.fit_loop.max_epochs = 2\n"
                      "sharding.fit(sharded_module, DataLoader(data, batch_size=8))\n"
                      "steps = sharding.global_step\n"
                      "full = {k: v.full_tensor() for k, v in sharded_module.state_dict().items()}")
    assert cluster.pull("steps") == [128 // NP // 8 * 2] * NP
    assert_identical_on_every_rank(cluster.pull("full"))
    result, out, err = run_cell(shell, capsys, "%%everyrank\nL.Trainer(accelerator='cpu', "
                                                "strategy='fsdp')")
    assert "requires a GPU accelerator" in str(result.error_in_exec), (out, err)


FSDP2 = f"""%%everyrank
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

mesh = init_device_mesh("cpu", ({NP},))
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total, group=mesh.get_group())

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
for layer in net:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(net, mesh=mesh)
opt = torch.optim.SGD(net.parameters(), lr=0.1)


def train(steps):
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()


train(5)
"""


def test_fsdp2_fully_shard_on_a_device_mesh_trains_across_cells(shell, capsys, cluster):
    ok(shell, capsys, FSDP2)
    assert cluster.pull("total") == [torch.tensor([float(sum(range(NP)))])] * NP
    ok(shell, capsys, "%%everyrank\nlocal = net[0].weight.to_local().shape[0]\n"
                      "full = {k: v.full_tensor() for k, v in net.state_dict().items()}")
    assert cluster.pull("local") == [32 // NP] * NP, "each rank holds its shard"
    before = cluster.pull("full")
    assert_identical_on_every_rank(before)
    ok(shell, capsys, "%%everyrank\ntrain(5)\n"
                      "full = {k: v.full_tensor() for k, v in net.state_dict().items()}")
    after = cluster.pull("full")
    assert_identical_on_every_rank(after)
    assert not after[0]["0.weight"].equal(before[0]["0.weight"]), "the next cell trained on"


def test_lightning_s_devices_auto_is_the_ranks_of_this_host(shell, capsys, cluster):
    pytest.importorskip("lightning")
    ok(shell, capsys, "%%everyrank\nauto = L.Trainer(accelerator='cpu', devices='auto', "
                      "strategy='ddp', max_epochs=1, logger=False, enable_checkpointing=False,"
                      " enable_progress_bar=False, enable_model_summary=False)\n"
                      "auto.fit(Regression(), DataLoader(data, batch_size=8))\n"
                      "sizes = (auto.world_size, auto.num_devices)")
    assert cluster.pull("sizes") == [(NP, NP)] * NP


@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_spawn"])
def test_a_lightning_strategy_that_starts_processes_says_what_to_use(shell, capsys, cluster,
                                                                     strategy):
    pytest.importorskip("lightning")
    result, out, err = run_cell(shell, capsys, f"%%everyrank\nL.Trainer(accelerator='cpu', "
                                                f"devices={NP}, strategy={strategy!r})")
    error = result.error_in_exec
    assert error is not None and error.ranks == list(range(NP)), (out, err)
    assert (f"Trainer(strategy={strategy!r}) starts processes of its own" in str(error)
            or f"Trainer(strategy={strategy!r}) starts processes of its own" in out + err), (
        str(error), err)
    assert "Use strategy='ddp'" in unwrapped(out + err), err


# The Hugging Face Trainer on a tiny GPT-2 built from its config (nothing downloaded: the hub
# is offline for the test), and Accelerate's own loop.
HF_TRAINER = ("""%%everyrank
import os, tempfile
os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

"""
    + TINY_GPT
    + """hf_out = tempfile.TemporaryDirectory()
args = TrainingArguments(output_dir=hf_out.name, per_device_train_batch_size=4, max_steps=8,
                         use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
hf = Trainer(model=gpt, args=args, train_dataset=Tokens())
hf.train()
hf_first = (hf.args.world_size, hf.state.global_step)
hf_state = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
""")


def test_the_hugging_face_trainer_trains_and_trains_on_in_the_next_cell(shell, capsys,
                                                                         cluster):
    pytest.importorskip("transformers")
    ok(shell, capsys, HF_TRAINER)
    assert cluster.pull("hf_first") == [(NP, 8)] * NP
    first = cluster.pull("hf_state")
    assert_identical_on_every_rank(first)
    ok(shell, capsys, "%%everyrank\nhf.train()\n"
                      "hf_state = {k: v.detach().clone() for k, v in gpt.state_dict().items()}\n"
                      "hf_out.cleanup()")
    second = cluster.pull("hf_state")
    assert_identical_on_every_rank(second)
    key = "transformer.h.0.attn.c_attn.weight"
    assert not second[0][key].equal(first[0][key]), "the next cell trained the same model on"


ACCELERATE = """%%everyrank
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
acc_model = torch.nn.Linear(8, 1)
acc_opt = torch.optim.SGD(acc_model.parameters(), lr=0.05)
acc_data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
acc_model, acc_opt, acc_data = accelerator.prepare(acc_model, acc_opt, acc_data)
for x, y in acc_data:
    acc_opt.zero_grad()
    loss = torch.nn.functional.mse_loss(acc_model(x), y)
    accelerator.backward(loss)
    acc_opt.step()
seen = accelerator.gather_for_metrics(torch.tensor([float(accelerator.process_index)]))
acc_result = (accelerator.num_processes, seen.tolist(),
              {k: v.detach().clone() for k, v in accelerator.unwrap_model(acc_model)
               .state_dict().items()})
"""


def test_accelerate_prepares_and_trains_on_the_ranks(shell, capsys, cluster):
    pytest.importorskip("accelerate")
    ok(shell, capsys, ACCELERATE)
    results = cluster.pull("acc_result")
    assert [r[:2] for r in results] == [(NP, [float(r) for r in range(NP)])] * NP
    assert_identical_on_every_rank([r[2] for r in results])


def test_accelerate_saves_its_state_in_one_cell_and_loads_it_in_the_next(shell, capsys,
                                                                        cluster):
    pytest.importorskip("accelerate")
    ok(shell, capsys, """%%everyrank
import tempfile
acc_dir = [tempfile.mkdtemp() if accelerator.is_main_process else None]
torch.distributed.broadcast_object_list(acc_dir, 0)
accelerator.save_state(acc_dir[0])
acc_saved = {k: v.detach().clone() for k, v in acc_model.state_dict().items()}
with torch.no_grad():
    for p in acc_model.parameters():
        p.add_(1.0)""")
    ok(shell, capsys, """%%everyrank
import shutil
accelerator.load_state(acc_dir[0])
acc_back = {k: v.detach().clone() for k, v in acc_model.state_dict().items()}
restored = all(acc_back[k].equal(acc_saved[k]) for k in acc_saved)
accelerator.wait_for_everyone()
if accelerator.is_main_process:
    shutil.rmtree(acc_dir[0])""")
    assert cluster.pull("restored") == [True] * NP
    assert_identical_on_every_rank(cluster.pull("acc_back"))


def test_what_lightning_and_the_hf_trainer_log_is_drawn_live(shell, capsys, cluster):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    history = cluster.metrics
    before = len(history)
    ok(shell, capsys, "%%everyrank\nfrom ipydist.integrations.lightning import LiveLogger\n"
                      "live = L.Trainer(accelerator='cpu', devices='auto', strategy='ddp', "
                      "max_epochs=2, logger=LiveLogger(total=8), log_every_n_steps=1, "
                      "enable_checkpointing=False, enable_progress_bar=False, "
                      "enable_model_summary=False)\n"
                      "live.fit(Regression(), DataLoader(data, batch_size=8))")
    steps, losses = history.series("loss", before)[:2]
    per_epoch = 128 // NP // 8
    assert list(steps) == list(range(per_epoch * 2)), "a point per step, at Lightning's steps"
    assert history.series("epoch", before)[1][-1] == 1.0 and history.total == 8
    before = len(history)
    ok(shell, capsys, "%%everyrank\nfrom ipydist.integrations.hf import LiveMetrics\n"
                      "args.logging_steps = 2\nhf_out = tempfile.TemporaryDirectory()\n"
                      "args.output_dir = hf_out.name\n"
                      "Trainer(model=gpt, args=args, train_dataset=Tokens(), "
                      "callbacks=[LiveMetrics()]).train()\nhf_out.cleanup()")
    steps = history.series("loss", before)[0]
    assert list(steps) == [1, 3, 5, 7] and history.total == 8, "the HF steps 2, 4, 6, 8"
    assert "train_runtime" not in history.columns, "the end's summary is not a curve"


# Data x tensor parallel on a 2-D mesh: each Linear split over "tp" (column-wise, then
# row-wise), the whole sharded over "dp" with FSDP2; saved with torch.distributed.checkpoint in
# one cell, loaded back in the next.
TWO_D = f"""%%everyrank
import shutil, tempfile
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

mesh2 = init_device_mesh("cpu", (2, {NP} // 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
parallelize_module(mlp, mesh2["tp"], {{"0": ColwiseParallel(), "2": RowwiseParallel()}})
fully_shard(mlp, mesh=mesh2["dp"])
mlp_opt = torch.optim.SGD(mlp.parameters(), lr=0.1)
torch.manual_seed(1 + mesh2["dp"].get_local_rank())
for _ in range(3):
    mlp_opt.zero_grad()
    mlp(torch.randn(4, 16)).pow(2).mean().backward()
    mlp_opt.step()
trained = {{k: v.full_tensor() for k, v in mlp.state_dict().items()}}
where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
dist.broadcast_object_list(where, 0)
dcp.save({{"model": mlp.state_dict()}}, checkpoint_id=where[0])
"""


@pytest.mark.skipif(NP % 2, reason="a 2 x N/2 mesh")
def test_a_2d_mesh_of_fsdp2_and_tensor_parallel_saves_and_loads_across_cells(shell, capsys,
                                                                             cluster):
    ok(shell, capsys, TWO_D)
    trained = cluster.pull("trained")
    assert_identical_on_every_rank(trained)
    assert trained[0]["0.weight"].shape == (32, 16)
    ok(shell, capsys, """%%everyrank
with torch.no_grad():
    for p in mlp.parameters():
        p.zero_()
loaded = {"model": mlp.state_dict()}
dcp.load(loaded, checkpoint_id=where[0])
mlp.load_state_dict(loaded["model"])
back = {k: v.full_tensor() for k, v in mlp.state_dict().items()}
dist.barrier()
if dist.get_rank() == 0:
    shutil.rmtree(where[0])""")
    back = cluster.pull("back")
    assert all(back[0][k].equal(trained[0][k]) for k in trained[0]), "loaded what was saved"
    assert_identical_on_every_rank(back)


# torch.compile on a DDP model: dynamo splits the graph at DDP's buckets so that the
# allreduces still overlap the backward pass. ``aot_eager`` compiles the graphs without
# inductor's C++ or Triton code generation (the default "inductor" works where a compiler is).
COMPILED_DDP = """%%everyrank
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
ddp_net = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
compiled = torch.compile(ddp_net, backend="aot_eager")
ddp_opt = torch.optim.SGD(ddp_net.parameters(), lr=0.05)


def compiled_steps(n):
    torch.manual_seed(1 + torch.distributed.get_rank())
    for _ in range(n):
        ddp_opt.zero_grad()
        compiled(torch.randn(4, 8)).pow(2).mean().backward()
        ddp_opt.step()
    return {k: v.detach().clone() for k, v in ddp_net.module.state_dict().items()}


compiled_state = compiled_steps(3)
"""


def test_torch_compile_on_a_ddp_model_trains_across_cells(shell, capsys, cluster):
    ok(shell, capsys, COMPILED_DDP)
    first = cluster.pull("compiled_state")
    assert_identical_on_every_rank(first)
    ok(shell, capsys, "%%everyrank\ncompiled_state = compiled_steps(3)")
    second = cluster.pull("compiled_state")
    assert_identical_on_every_rank(second)
    assert not second[0]["0.weight"].equal(first[0]["0.weight"]), "the next cell trained on"
