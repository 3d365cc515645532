"""shard / scale_lr and checkpoints: sampler logic alone, then on a real 4-rank cluster, and the
atomic write surviving a SIGKILL in the middle of it."""

from __future__ import annotations

import fractions
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import NP, as_merged, run_cell
from torch.utils.data import DistributedSampler

from ipydist.errors import RankError
from ipydist.torch.training.checkpoint import _atomic_save
from ipydist.torch.training.data import ShardSampler


def parts(n: int, replicas: int, **kwargs) -> list[list[int]]:
    """Every rank's indices of a data set of ``n`` items."""
    return [
        list(ShardSampler(range(n), num_replicas=replicas, rank=r, **kwargs))
        for r in range(replicas)
    ]


# --- ShardSampler, pure logic -------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 10, 12, 13, 101])
@pytest.mark.parametrize("replicas", [1, 3, 4])
def test_parts_cover_the_data_set_with_equal_counts(n, replicas):
    got = parts(n, replicas, seed=5)
    per_rank = math.ceil(n / replicas)
    assert [len(p) for p in got] == [per_rank] * replicas
    everything = [i for p in got for i in p]
    assert set(everything) == set(range(n))
    assert len(everything) - n == per_rank * replicas - n, "only the padding repeats"
    if n % replicas == 0:
        assert sorted(everything) == list(range(n)), "parts are disjoint"


def test_padding_repeats_the_first_indices_of_the_permutation():
    assert parts(10, 4, shuffle=False) == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert parts(2, 4, shuffle=False) == [[0], [1], [0], [1]]
    shuffled = parts(10, 4, seed=3)
    interleaved = [shuffled[r][k] for k in range(3) for r in range(4)]
    assert interleaved[10:] == interleaved[:2]
    assert sorted(interleaved[:10]) == list(range(10))


@pytest.mark.parametrize("n, replicas", [(10, 4), (13, 3), (3, 4), (12, 4)])
def test_drop_last_leaves_out_the_tail(n, replicas):
    got = parts(n, replicas, drop_last=True, seed=1)
    assert [len(p) for p in got] == [n // replicas] * replicas
    everything = [i for p in got for i in p]
    assert len(set(everything)) == len(everything) == replicas * (n // replicas)
    assert parts(10, 4, shuffle=False, drop_last=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_len_matches_what_iterating_gives():
    for n, replicas, drop_last in [(10, 4, False), (10, 4, True), (0, 2, False), (7, 1, True)]:
        for r in range(replicas):
            s = ShardSampler(range(n), num_replicas=replicas, rank=r, drop_last=drop_last)
            assert len(s) == len(list(s))


def test_set_epoch_reshuffles_deterministically_and_alike_on_every_rank():
    def epoch_parts(epoch, seed=0):
        samplers = [ShardSampler(range(100), seed=seed, num_replicas=4, rank=r) for r in range(4)]
        for s in samplers:
            s.set_epoch(epoch)
        return [list(s) for s in samplers]

    e0, e1 = epoch_parts(0), epoch_parts(1)
    assert e0 == epoch_parts(0) and e1 == epoch_parts(1), "same epoch, same order"
    assert e0 != e1 and epoch_parts(0, seed=1) != e0
    for got in (e0, e1):
        assert sorted(i for p in got for i in p) == list(range(100)), "disjoint and covering"
    assert list(ShardSampler(range(8), shuffle=False, num_replicas=2, rank=0)) == [0, 2, 4, 6]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n, replicas", [(10, 4), (3, 4), (64, 4), (101, 3)])
def test_same_indices_as_torch_distributed_sampler(shuffle, drop_last, n, replicas):
    """Code moving from DistributedSampler sees the very same batches."""
    for r in range(replicas):
        ours = ShardSampler(range(n), shuffle, 11, drop_last, num_replicas=replicas, rank=r)
        theirs = DistributedSampler(
            range(n), num_replicas=replicas, rank=r, shuffle=shuffle, seed=11, drop_last=drop_last
        )
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"rank=4, but ranks are 0\.\.3"):
        ShardSampler(range(8), num_replicas=4, rank=4)
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        ShardSampler(range(8), num_replicas=0, rank=0)
    with pytest.raises(TypeError, match="needs a data set with a length"):
        ShardSampler(iter(range(8)), num_replicas=2, rank=0)


# --- the atomic writer, without a cluster -------------------------------------------------


def test_atomic_save_failure_removes_its_temp_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "ckpt.pt"
    _atomic_save({"step": 1}, str(path))
    with pytest.raises(Exception, match="lambda"):
        _atomic_save({"step": 2, "fn": lambda: 0}, str(path))
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert torch.load(path, weights_only=True) == {"step": 1}


def test_atomic_save_file_mode_follows_the_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        _atomic_save({"step": 1}, str(tmp_path / "ckpt.pt"))
    finally:
        os.umask(umask)
    assert (tmp_path / "ckpt.pt").stat().st_mode & 0o777 == 0o644


WRITER = r"""
import sys, torch
from ipydist.torch.training.checkpoint import _atomic_save
path, numel = sys.argv[1], int(sys.argv[2])
_atomic_save({"step": 1, "w": torch.arange(10.0)}, path)
big = torch.ones(numel)
print("first written", flush=True)
_atomic_save({"step": 2, "w": big}, path)
print("second written", flush=True)
"""


def _kill_while_writing(directory, numel: int):
    """Run WRITER; SIGKILL it once the second checkpoint's temp file is growing.

    Returns (killed before the rename?, the temp file seen, the writer's output).
    """
    path = directory / "ckpt.pt"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(numel)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    seen = None
    try:
        first = proc.stdout.readline()
        assert first == "first written\n", f"writer failed: {first}{proc.stderr.read()}"
        first_size = 0
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            temps = list(directory.glob(".ckpt.pt.*.tmp"))
            if temps:
                seen = temps[0]
                try:
                    size = seen.stat().st_size
                except FileNotFoundError:  # renamed already: too late for this attempt
                    break
                if first_size and size > first_size:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                first_size = first_size or size
            time.sleep(0.0005)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # the test failed on the way: leave nothing running
            proc.kill()
            proc.communicate()
    killed = proc.returncode == -signal.SIGKILL and "second written" not in out
    step = torch.load(path, weights_only=True)["step"]
    return killed and step == 1, seen, out


def test_sigkill_during_a_write_leaves_the_previous_checkpoint(tmp_path):
    """A writer killed mid-write leaves ``path`` holding the complete first checkpoint."""
    for attempt, numel in enumerate([50_000_000, 200_000_000]):  # 200 MB, then 800 MB
        directory = tmp_path / f"attempt{attempt}"
        directory.mkdir()
        caught, temp, out = _kill_while_writing(directory, numel)
        if caught:
            break
    else:
        pytest.fail(f"the write always finished before the kill; writer said: {out!r}")
    assert temp is not None and temp.exists(), "the kill came before the rename"
    assert temp.stat().st_size > 0
    loaded = torch.load(directory / "ckpt.pt", weights_only=True)
    assert loaded.keys() == {"step", "w"} and loaded["step"] == 1
    assert loaded["w"].equal(torch.arange(10.0))
    assert sorted(os.listdir(directory)) == sorted([temp.name, "ckpt.pt"])
    temp.unlink()


# --- on a real 4-rank cluster ---------------------------------------------------------------


@pytest.fixture
def cluster(cluster, shell):
    """The shared cluster, with torch and ``hvd`` on every rank: a test here must not rely on
    an earlier one's names (the cluster may have been started again since; issue 46)."""
    shell.run_cell("%everyrank import torch, ipydist.torch as hvd").raise_error()
    return cluster


def ok(shell, capsys, code: str):
    result, out, err = run_cell(shell, capsys, code)
    if result.error_in_exec is not None:
        raise AssertionError(f"cell failed: {result.error_in_exec!r}\n{out}\n{err}")
    return result, out, err


def fails_everywhere(shell, capsys, code: str) -> RankError:
    result, _, _ = run_cell(shell, capsys, code)
    error = result.error_in_exec
    assert isinstance(error, RankError), repr(error)
    assert error.ranks == list(range(NP))
    rendered = "\n".join(error._render_traceback_())
    assert f"(ranks 1-{NP - 1}: the same {error.ename})" in rendered
    return error


def test_every_rank_gets_its_own_shard(shell, capsys, cluster):
    ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
from torch.utils.data import DataLoader, TensorDataset
ds = TensorDataset(torch.arange(100))
sampler = hvd.shard(ds, seed=7)
loader = DataLoader(ds, batch_size=8, sampler=sampler)
seen = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    seen.append([int(x) for (batch,) in loader for x in batch])
uneven = list(hvd.shard(range(10), shuffle=False))
lengths = (len(sampler), len(hvd.shard(range(10))), len(hvd.shard(range(10), drop_last=True)))
lr = hvd.scale_lr(0.1)
""")
    seen = shell.run_line_magic("dist_pull", "seen")
    for epoch in range(2):
        got = [seen[r][epoch] for r in range(NP)]
        assert [len(p) for p in got] == [100 // NP] * NP
        assert sorted(i for p in got for i in p) == list(range(100))
        expected = []
        for r in range(NP):
            s = ShardSampler(range(100), seed=7, num_replicas=NP, rank=r)
            s.set_epoch(epoch)
            expected.append(list(s))
        assert got == expected
    assert seen[0][0] != seen[0][1], "set_epoch reshuffles"
    uneven = [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert shell.run_line_magic("dist_pull", "uneven") == uneven
    assert shell.run_line_magic("dist_pull", "lengths") == [(25, 3, 2)] * NP
    assert shell.run_line_magic("dist_pull", "lr") == [0.4] * NP


def assert_identical(a, b, where="checkpoint"):
    """Equal values, tensors bit for bit with the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_checkpoint_round_trip_on_every_rank(shell, capsys, cluster, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    ok(shell, capsys, f"""%%everyrank
import copy, os, torch, ipydist.torch as hvd
def make():
    return torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
torch.manual_seed(hvd.rank())  # different weights and optimizer state on every rank
model = make()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(2):
    opt.zero_grad(); model(torch.randn(8, 5)).square().mean().backward(); opt.step()
saved = copy.deepcopy(dict(model=model.state_dict(), optimizer=opt.state_dict()))
hvd.save_checkpoint({path!r}, model=model, optimizer=opt, epoch=3, note="after two steps")
there = os.path.exists({path!r})
""")
    assert shell.run_line_magic("dist_pull", "there") == [True] * NP
    assert os.listdir(tmp_path) == ["ckpt.pt"], "one file, no temp files left"
    ok(shell, capsys, f"""%%everyrank
torch.manual_seed(100 + hvd.rank())
model2 = make()
opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
ckpt = hvd.load_checkpoint({path!r})
model2.load_state_dict(ckpt["model"])
opt2.load_state_dict(ckpt["optimizer"])
restored = dict(model=model2.state_dict(), optimizer=opt2.state_dict())
extra = (sorted(ckpt), ckpt["epoch"], ckpt["note"])
""")
    saved = shell.run_line_magic("dist_pull", "saved")
    restored = shell.run_line_magic("dist_pull", "restored")
    assert not saved[1]["model"]["0.weight"].equal(saved[0]["model"]["0.weight"])
    for r in range(NP):
        assert_identical(saved[0], restored[r], f"rank {r}")
    assert shell.run_line_magic("dist_pull", "extra") == [
        (["epoch", "model", "note", "optimizer"], 3, "after two steps")
    ] * NP


def test_load_of_a_missing_file_fails_on_every_rank(shell, capsys, cluster, tmp_path):
    missing = str(tmp_path / "nothing-here.pt")
    error = fails_everywhere(shell, capsys, f"%everyrank hvd.load_checkpoint({missing!r})")
    assert error.ename == "FileNotFoundError"
    assert f"no checkpoint file at {missing}" in error.evalue


def test_save_into_a_missing_directory_fails_on_every_rank(shell, capsys, cluster, tmp_path):
    bad = str(tmp_path / "no-such-dir" / "ckpt.pt")
    error = fails_everywhere(
        shell, capsys, f"%%everyrank --timeout 60\nhvd.save_checkpoint({bad!r}, x=torch.ones(2))"
    )
    assert error.ename == "RuntimeError"
    assert error.evalue.startswith(f"rank 0 could not write checkpoint {bad}: FileNotFoundError")
    assert os.listdir(tmp_path) == []
    _, out, _ = ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum))")
    assert f"[all ranks] tensor([{float(NP):g}.])" in as_merged(out), "ranks are in step afterwards"


def test_failed_save_keeps_the_earlier_checkpoint(shell, capsys, cluster, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    ok(shell, capsys, f"%everyrank hvd.save_checkpoint({path!r}, step=1)")
    error = fails_everywhere(
        shell, capsys, f"%everyrank hvd.save_checkpoint({path!r}, step=2, fn=lambda: 0)"
    )
    assert error.evalue.startswith(f"rank 0 could not write checkpoint {path}: ")
    assert "earlier checkpoint there is unchanged" in error.evalue
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    ok(shell, capsys, f"%everyrank step = hvd.load_checkpoint({path!r})['step']")
    assert shell.run_line_magic("dist_pull", "step") == [1] * NP


def test_weights_only_refuses_other_objects_unless_asked(shell, capsys, cluster, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    ok(shell, capsys, f"""%%everyrank
import fractions
hvd.save_checkpoint({path!r}, ratio=fractions.Fraction(1, 3))
""")
    error = fails_everywhere(shell, capsys, f"%everyrank hvd.load_checkpoint({path!r})")
    assert error.ename == "ValueError"
    assert "fractions.Fraction" in error.evalue
    assert "load_checkpoint(path, weights_only=False)" in error.evalue
    ok(shell, capsys, f"%everyrank ratio = hvd.load_checkpoint({path!r}, weights_only=False)")
    assert shell.run_line_magic("dist_pull", "ratio") == [{"ratio": fractions.Fraction(1, 3)}] * NP
