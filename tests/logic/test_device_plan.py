"""Which GPU a rank uses, and what it may see (issue 29, item 8): pure logic, no GPU."""

from __future__ import annotations

import pytest

from ipydist.errors import LaunchError
from ipydist.notebook.launch import mpiexec
from ipydist.rank import device


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
    with pytest.raises(LaunchError, match="NCCL needs one GPU per rank"):
        device.plan_device("auto", 1, 4, 1, "auto")  # one GPU shared by 4 ranks


@pytest.mark.parametrize(("gpus", "local_rank", "local_size", "count", "index"), [
    ("auto", 1, 2, 4, 1),  # fewer ranks than GPUs: GPU local_rank
    ([1, 3], 1, 2, 2, 1),  # after CUDA_VISIBLE_DEVICES=1,3: index within it
    ("auto", 0, 1, 0, None),  # no GPU: CPU
])
def test_plan_device(gpus, local_rank, local_size, count, index):
    assert device.plan_device(gpus, local_rank, local_size, count, "auto") == index


def test_the_notebook_counts_gpus_within_its_allocation(monkeypatch):
    monkeypatch.setattr(mpiexec.os.path, "exists", lambda path: False)  # no ROCm
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    mpiexec.check_gpus_here([0, 1], "auto")
    with pytest.raises(LaunchError, match=r"names GPU 2, but this host has 2 GPU\(s\) in "
                                          r"CUDA_VISIBLE_DEVICES \(4,5\)"):
        mpiexec.check_gpus_here([2], "auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(LaunchError, match="--backend nccl needs GPUs"):
        mpiexec.check_gpus_here("auto", "nccl")
