"""More ranks than GPUs on a host (issue 48): GPUs dealt round-robin, how CUDA tensors travel
on the machine's NCCL, the default ``--np`` from the GPUs the cluster may use, and the start
table's line. Pure logic, no GPU (``tests/cluster/test_gpu_shared.py`` runs it on one)."""

from __future__ import annotations

import pytest
import torch

import ipydist
from ipydist.errors import LaunchError
from ipydist.notebook.launch import local_gpus
from ipydist.notebook.launch.planning import plan_launch
from ipydist.notebook.reports.status import SHARING_COSTS, sharing_note, start_table
from ipydist.protocol import RankInfo
from ipydist.rank import device
from ipydist.torch._core import gpu_sharing, shims, topology

OLD_NCCL, SHARING_NCCL = (2, 28, 9), (2, 30, 3)


@pytest.mark.parametrize(("local_size", "gpus", "dealt"), [
    (4, 1, [0, 0, 0, 0]),  # a one-GPU workstation: every rank on it
    (4, 2, [0, 1, 0, 1]),
    (3, 2, [0, 1, 0]),
    (2, 4, [0, 1]),  # fewer ranks than GPUs: one each, the rest idle
])
def test_gpus_are_dealt_round_robin(local_size, gpus, dealt):
    assert [device.plan_device("auto", r, local_size, gpus, "auto")
            for r in range(local_size)] == dealt
    assert [device.plan_device("auto", r, local_size, gpus, "nccl")
            for r in range(local_size)] == dealt


@pytest.mark.parametrize(("local_size", "gpus", "own", "per_gpu"), [
    (4, 1, False, 4), (4, 2, False, 2), (3, 2, False, 2), (2, 2, False, 1),
    (2, 8, False, 1), (4, 0, False, 0), (4, 1, True, 1)])
def test_ranks_per_gpu(local_size, gpus, own, per_gpu):
    assert gpu_sharing.ranks_per_gpu(local_size, gpus, own) == per_gpu


@pytest.mark.parametrize(("backend", "nccl", "way"), [
    ("auto", SHARING_NCCL, "nccl"),  # NCCL 2.30's shared mode
    ("auto", (2, 31, 0), "nccl"),
    ("auto", (3, 0, 0), "nccl"),
    ("auto", OLD_NCCL, "gloo"),  # NCCL would refuse: "Duplicate GPU detected"
    ("auto", None, "gloo"),  # a torch without NCCL
    ("nccl", SHARING_NCCL, "nccl"),
    ("nccl", OLD_NCCL, "nccl-hostid"),  # asked for NCCL: its socket route
    ("gloo", SHARING_NCCL, "gloo"),
    ("mpi", OLD_NCCL, "mpi"),
])
def test_how_cuda_tensors_travel_between_ranks_sharing_a_gpu(backend, nccl, way):
    assert gpu_sharing.sharing_way(backend, nccl) == way
    assert way in gpu_sharing.SHARING_WAYS and way in SHARING_COSTS


def test_nccl_asked_of_a_torch_without_nccl_says_what_to_do():
    with pytest.raises(LaunchError, match="this torch has no NCCL.*leave --backend out"):
        gpu_sharing.sharing_way("nccl", None)


def test_nccl_versions_as_torch_reports_them():
    assert gpu_sharing.nccl_version((2, 28, 9)) == (2, 28, 9)
    assert gpu_sharing.nccl_version(22809) == (2, 28, 9)  # one number, in older torch
    assert gpu_sharing.nccl_version((2, 30)) == (2, 30, 0)


def test_the_environment_nccl_is_given_for_each_way():
    assert gpu_sharing.sharing_env("nccl", 2, "h", 1, {}) == {
        "NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    assert gpu_sharing.sharing_env("nccl", 4, "h", 1, {})["NCCL_MAX_CTAS"] == "2"
    # what the user set (--env) is kept
    assert gpu_sharing.sharing_env("nccl", 4, "h", 1, {"NCCL_MAX_CTAS": "1"}) == {
        "NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    ids = [gpu_sharing.sharing_env("nccl-hostid", 4, "h", r, {"NCCL_HOSTID": "same"})
           for r in range(4)]
    assert len({e["NCCL_HOSTID"] for e in ids}) == 4  # one each, over the user's one
    assert gpu_sharing.sharing_env("gloo", 4, "h", 1, {}) == {}


@pytest.mark.parametrize(("backend", "index", "way", "resolved"), [
    ("auto", 0, "", "nccl"), ("auto", 0, "nccl", "nccl"), ("auto", 0, "gloo", "gloo"),
    ("auto", None, "", "gloo"), ("nccl", 0, "nccl-hostid", "nccl"), ("gloo", 0, "", "gloo"),
])
def test_resolve_backend_when_sharing(backend, index, way, resolved):
    assert gpu_sharing.resolve_backend(backend, index, way) == resolved


def test_every_rank_agrees_on_one_backend():
    assert device.agree_backend(["nccl", "nccl"], [None, None]) == "nccl"
    # a host without GPUs (or sharing one over gloo) cannot join an NCCL group
    assert device.agree_backend(["nccl", "gloo", "nccl"], [None] * 3) == "gloo"
    # a heal: the survivors' group stays what it is
    assert device.agree_backend(["gloo", "nccl"], [None, "nccl"]) == "nccl"


@pytest.mark.parametrize(("gpus", "inherited", "host_gpus", "per_rank", "np"), [
    ([0, 1], None, 8, 1, 2),  # --gpus 0,1 on an 8-GPU node: 2 ranks, not 8
    ("auto", "4,5,6", 8, 1, 3),  # a scheduler's CUDA_VISIBLE_DEVICES
    ("auto", None, 8, 1, 8),  # the host's
    ("auto", None, 8, 2, 4),
    ([0, 1, 2, 3], "0,1,2,3,4,5,6,7", 8, 2, 2),
    ("none", None, 8, 1, "cores"),
    ("auto", "", 8, 1, "cores"),  # CUDA_VISIBLE_DEVICES empty: no GPU
    ("auto", None, 0, 1, "cores"),
])
def test_default_np_counts_the_gpus_the_cluster_may_use(monkeypatch, gpus, inherited,
                                                        host_gpus, per_rank, np):
    monkeypatch.setattr(local_gpus, "list_gpus",
                        lambda: [f"GPU {i}: H200" for i in range(host_gpus)])
    expected = local_gpus.os.cpu_count() if np == "cores" else np
    assert local_gpus.default_np(gpus, per_rank, inherited) == expected


def test_a_launch_without_np_starts_one_rank_per_gpu_of_the_gpus_list(monkeypatch):
    monkeypatch.setattr(local_gpus, "list_gpus", lambda: [f"GPU {i}: H200" for i in range(8)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert plan_launch(ipydist.StartOptions().changed(gpus="0,1")).np == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    assert plan_launch(ipydist.StartOptions()).np == 3


def _ranks(devices: list[str], way: str, host: str = "ws") -> list[RankInfo]:
    return [RankInfo(rank=r, size=len(devices), host=host, pid=100 + r, device=d,
                     backend="gloo", gpu_sharing=way) for r, d in enumerate(devices)]


def test_the_start_table_says_in_one_line_that_ranks_share_and_what_it_costs():
    ranks = _ranks(["cuda:0"] * 4, "gloo")
    note = sharing_note(ranks)
    assert note.startswith("4 ranks share 1 GPU on ws, dealt round-robin")
    assert "gloo through host memory" in note and "NCCL 2.30" in note
    assert "\n" not in note
    assert note in " ".join(str(start_table(ranks, 1.0)).split())  # wrapped as text
    assert note in start_table(ranks, 1.0)._repr_html_()
    two_hosts = _ranks(["cuda:0", "cuda:1"] * 2, "nccl", "a") + _ranks(
        ["cuda:0", "cuda:1"] * 2, "nccl", "b")
    assert sharing_note(two_hosts).startswith("4 ranks share 2 GPUs on each of 2 hosts")
    assert "NCCL_MULTI_RANK_GPU_ENABLE" in sharing_note(two_hosts)
    assert sharing_note(_ranks(["cuda:0", "cuda:1"], "")) == ""  # a GPU each: no line
    assert "share" not in str(start_table(_ranks(["cpu", "cpu"], ""), 1.0))


def _runtime(way: str, local_rank: int = 2, backend: str = "gloo") -> topology.Runtime:
    rt = topology.Runtime(rank=local_rank, size=4, local_rank=local_rank, local_size=4,
                          host="ws")
    rt.device_index, rt.gpu_sharing, rt.backend = 0, way, backend
    return rt


def test_code_that_asks_for_nccl_keeps_the_gloo_of_ranks_sharing_a_gpu():
    """A DDP script's ``init_process_group("nccl")`` where NCCL cannot share the GPU."""
    assert shims.plain_backend("nccl", _runtime("gloo")) == "gloo"
    assert shims.plain_backend("cpu:gloo,cuda:nccl", _runtime("gloo")) == "gloo"
    assert shims.plain_backend("nccl", _runtime("nccl", backend="nccl")) == "nccl"
    assert shims.plain_backend("nccl", _runtime("")) == "nccl"


def test_horovods_set_device_of_the_local_rank_pins_the_gpu_dealt(monkeypatch, capsys):
    """``torch.cuda.set_device(hvd.local_rank())`` on local rank 2 of 4 ranks sharing one
    GPU names a GPU that is not there: it pins the one the rank was dealt."""
    pinned: list = []
    monkeypatch.setattr(torch.cuda, "set_device", pinned.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(topology, "_runtime", _runtime("gloo", local_rank=2))
    monkeypatch.setattr(shims, "_set_device_announced", False)
    shims.install_shared_gpu_shim()
    torch.cuda.set_device(2)
    torch.cuda.set_device(torch.device("cuda", 2))
    torch.cuda.set_device("cuda:0")
    torch.cuda.set_device(3)  # not this rank's local rank: as given (torch says what is wrong)
    assert pinned == [0, 0, 0, 3]
    err = capsys.readouterr().err
    assert err.count("pins cuda:0, the GPU this rank was dealt") == 1, err
