"""Which GPU a rank uses, and what it may see (issue 29, item 8): pure logic, no GPU."""

from __future__ import annotations

import re

import pytest

from ipydist.errors import LaunchError
from ipydist.notebook.launch import local_gpus
from ipydist.protocol import RankConfig
from ipydist.rank import device
from ipydist.specs import SpecError, parse_gpus_per_rank
from ipydist.torch._core import gpu_sharing


@pytest.mark.parametrize(("gpus", "inherited", "visible"), [
    ("auto", None, None),  # left as it is: every GPU of the host
    ("auto", "2,3", None),  # what the scheduler gave
    ([0, 1], None, "0,1"),
    ([1, 3], "4,5,6,7", "5,7"),  # counted within the allocation, never escaping it
    ([0], "GPU-8f1c,MIG-1a2b", "GPU-8f1c"),  # UUIDs and MIG names kept as written
    ("none", None, ""),  # hidden: user code cannot take a GPU the cluster was not given
    ("none", "0,1", ""),
])
def test_visible_devices(gpus, inherited, visible):
    assert device.visible_devices(gpus, inherited) == visible


@pytest.mark.parametrize(("gpus", "inherited", "says"), [
    ([1, 4], "4,5,6,7", "names GPU 4, but this rank was given GPUs 0-3 (4,5,6,7)"),
    ([0], "", "no GPU (CUDA_VISIBLE_DEVICES is empty)"),
])
def test_a_gpu_outside_the_allocation_is_refused_with_what_was_given(gpus, inherited, says):
    with pytest.raises(LaunchError, match="--gpus counts within CUDA_VISIBLE_DEVICES") as e:
        device.visible_devices(gpus, inherited)
    assert says in str(e.value)


@pytest.mark.parametrize(("on_host", "own"), [
    (["0", "1", "2", "3"], True),  # Slurm --gpus-per-task=1
    (["0,1", "2,3"], True),  # two each
    (["0,1", "0,1"], False),  # the same GPUs for both: shared
    ([None, None], False),  # nothing inherited
    (["0", None], False),
    (["0", ""], False),
    (["0"], False),  # one rank alone: nothing to tell
])
def test_own_gpus(on_host, own):
    assert device.own_gpus(on_host) is own


def test_one_visible_gpu_per_rank_is_not_too_few():
    """Slurm's --gpus-per-task=1: each of 4 ranks sees one GPU, its own: device 0 each."""
    for rank in range(4):
        assert device.plan_device("auto", rank, 4, 1, "auto", own_gpus=True) == 0
    assert gpu_sharing.ranks_per_gpu(4, 1, own_gpus=True) == 1  # none of them shares


@pytest.mark.parametrize(("gpus", "local_rank", "local_size", "count", "index"), [
    ("auto", 1, 2, 4, 1),  # fewer ranks than GPUs: GPU local_rank
    ([1, 3], 1, 2, 2, 1),  # after CUDA_VISIBLE_DEVICES=1,3: index within it
    ("auto", 0, 1, 0, None),  # no GPU: CPU
])
def test_plan_device(gpus, local_rank, local_size, count, index):
    assert device.plan_device(gpus, local_rank, local_size, count, "auto") == index


def test_the_notebook_counts_gpus_within_its_allocation(monkeypatch):
    monkeypatch.setattr(local_gpus.os.path, "exists", lambda path: False)  # no ROCm
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    local_gpus.check_gpus_here([0, 1], "auto")
    with pytest.raises(LaunchError, match=r"names GPU 2, but this host has 2 GPU\(s\) in "
                                          r"CUDA_VISIBLE_DEVICES \(4,5\)"):
        local_gpus.check_gpus_here([2], "auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(LaunchError, match="--backend nccl needs GPUs"):
        local_gpus.check_gpus_here("auto", "nccl")


# --- --gpus-per-rank (issue 31, item 5) --------------------------------------------------

@pytest.mark.parametrize(("gpus", "inherited", "local_rank", "own", "count", "visible"), [
    ("auto", None, 0, False, 4, "0,1"),  # the host's GPUs dealt out in local-rank order
    ("auto", None, 1, False, 4, "2,3"),
    ("auto", "4,5,6,7", 1, False, 0, "6,7"),  # within what the ranks inherited
    ([1, 2, 3, 0], "4,5,6,7", 1, False, 0, "7,4"),  # within the --gpus list, in its order
    ("auto", "GPU-a,GPU-b", 1, True, 8, "GPU-a,GPU-b"),  # given its own (Slurm): kept
])
def test_gpus_per_rank_deals_out_the_hosts_gpus(gpus, inherited, local_rank, own, count,
                                                visible):
    assert device.visible_for_rank(gpus, inherited, 2, local_rank, 2, own, count) == visible


def test_one_gpu_per_rank_is_the_plan_without_the_option():
    assert device.visible_for_rank("auto", "2,3", 1, 1, 2, False, 4) is None
    assert device.visible_for_rank([1], None, 1, 0, 2, False, 4) == "1"


@pytest.mark.parametrize(("gpus", "inherited", "own", "count", "fragment"), [
    ("auto", None, False, 3, "needs 4 GPU(s), but the 2 ranks on this host were given 3."),
    ("auto", "0,1,2", False, 8, "were given 3 (0,1,2). Use fewer ranks per host"),
    ("auto", "5", True, 8, "needs 2 GPU(s), but this rank was given 1 (5)"),
    ("none", None, False, 8, "--gpus-per-rank 2 needs GPUs, but --gpus none was given."),
])
def test_gpus_per_rank_asking_for_too_many_says_what_to_change(gpus, inherited, own, count,
                                                                fragment):
    with pytest.raises(LaunchError, match=re.escape(fragment)):
        device.visible_for_rank(gpus, inherited, 2, 0, 2, own, count)


def test_the_notebook_checks_gpus_per_rank_before_a_one_host_launch(monkeypatch):
    monkeypatch.setattr(local_gpus.os.path, "exists", lambda path: False)  # no ROCm
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    local_gpus.check_gpus_here("auto", "auto", 2, 2)
    with pytest.raises(LaunchError, match=re.escape(
            "--np 3 with --gpus-per-rank 2 needs 6 GPUs, but this host has 4 GPU(s) in "
            "CUDA_VISIBLE_DEVICES (0,1,2,3). Use a smaller --np or --gpus-per-rank.")):
        local_gpus.check_gpus_here("auto", "auto", 3, 2)
    with pytest.raises(LaunchError, match=re.escape("(2 of --gpus 0,1)")):
        local_gpus.check_gpus_here([0, 1], "auto", 2, 2)
    monkeypatch.setattr(local_gpus, "list_gpus", lambda: [f"GPU {i}: A" for i in range(8)])
    assert local_gpus.default_np("auto", 2, "0,1,2,3") == 2  # 4 inherited GPUs, 2 each
    assert local_gpus.default_np("auto", 2, None) == 4  # the host's 8


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", True])
def test_gpus_per_rank_must_be_a_whole_number(value):
    with pytest.raises(SpecError, match=r"--gpus-per-rank .*: expected a whole number of GPUs"):
        parse_gpus_per_rank(value)


def test_gpus_per_rank_reaches_the_ranks():
    config = RankConfig(gpus="0,1,2,3", gpus_per_rank=2)
    assert RankConfig.from_env(config.to_env()) == config
    assert RankConfig.from_env(RankConfig().to_env()).gpus_per_rank == 1
