"""Which backend ipydist makes, and which group carries a tensor (issue 29): pure logic, plus
one single-process group where torch itself must answer."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ipydist.protocol import MPI_BACKEND
from ipydist.torch._core import process_group, shims, topology
from ipydist.torch._wire import starts
from ipydist.torch.horovod.process_sets import SetComms


def _runtime(device_index=None, backend="gloo", cpu_group=None) -> topology.Runtime:
    return topology.Runtime(rank=0, size=2, local_rank=0, local_size=2, host="h",
                            device_index=device_index, backend=backend, cpu_group=cpu_group)


@pytest.fixture
def runtime():
    saved = topology.get()
    yield lambda **kw: (topology.set_runtime(_runtime(**kw)), topology.get())[1]
    topology.set_runtime(saved)


@pytest.mark.parametrize(("asked", "device_index", "made"), [
    (None, None, "gloo"),  # the cluster's own
    ("gloo", None, "gloo"),
    ("NCCL", 0, "nccl"),
    ("cpu:gloo,cuda:nccl", 0, "nccl"),  # what ipydist's nccl is
    ("cpu:gloo, cuda:nccl", None, "gloo"),  # no GPU: NCCL cannot be made, gloo serves CPU
    ("cuda:gloo", None, "cuda:gloo"),  # any other form goes to torch as it is
    ("ucc", 0, "ucc"),
    (MPI_BACKEND, None, MPI_BACKEND),
])
def test_plain_backend(asked, device_index, made):
    assert shims.plain_backend(asked, _runtime(device_index=device_index)) == made


def test_torchs_mpi_stands_for_ipydists_when_torch_has_none():
    made = shims.plain_backend("mpi", _runtime())
    assert made == ("mpi" if dist.is_mpi_available() else MPI_BACKEND)


def test_nccl_is_made_with_gloo_for_cpu_tensors():
    assert process_group.torch_backend("nccl") == "cpu:gloo,cuda:nccl"
    assert process_group.torch_backend("gloo") == "gloo"
    assert process_group.torch_backend("cuda:gloo") == "cuda:gloo"


def test_cpu_tensors_go_over_the_side_group_when_there_is_one(runtime):
    side, sets_side, sets_own = object(), object(), object()
    runtime(backend="cuda:gloo", cpu_group=side)
    cpu, cuda = torch.ones(1), torch.ones(1, device="meta")  # meta stands for a GPU here
    assert starts.torch_group_of(None, cpu) is side
    assert starts.torch_group_of(None) is side  # objects, the check: pickled on the CPU
    assert starts.torch_group_of(None, cuda) is None  # the default group: NCCL
    pset = SetComms([0, 1], 0, None, None, sets_own, sets_side)
    assert starts.torch_group_of(pset, cpu) is sets_side
    assert starts.torch_group_of(pset, cuda) is sets_own
    runtime(backend="gloo")  # a default group that serves CPU: no side group
    assert starts.torch_group_of(None, cpu) is None
    assert starts.torch_group_of(SetComms([0, 1], 0, None, None, sets_own), cpu) is sets_own


def test_nccl_communicators_are_aborted_together(monkeypatch):
    calls = []

    class Backend:
        def __init__(self, name):
            self.name = name

        def _group_start(self):
            calls.append("start")

        def _group_end(self):
            calls.append("end")

        def abort(self):
            calls.append(f"abort {self.name}")

    monkeypatch.setattr(process_group, "nccl_backends",
                        lambda: [Backend("world"), Backend("set"), Backend("user")])
    process_group._abort_nccl()
    assert calls == ["start", "abort world", "abort set", "abort user", "end"]


def test_a_group_of_cuda_only_needs_a_side_group(tmp_path):
    """torch's own answer, on one process: ``cuda:gloo`` (the stand-in for NCCL alone) has no
    backend for CPU tensors, ``cpu:gloo,cuda:gloo`` and gloo have."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("cuda:gloo", store=store, rank=0, world_size=1)
    try:
        assert not process_group.serves_cpu(dist.group.WORLD)
        with pytest.raises(RuntimeError, match="device type cpu"):
            dist.all_reduce(torch.ones(1))
        side = dist.new_group(backend="gloo")
        assert process_group.serves_cpu(side)
    finally:
        dist.destroy_process_group()


def test_nccl_error_handling_leaves_the_process_alive(monkeypatch):
    """ipydist sets 2 (abort the communicators, raise in the operation), never torch's
    default that ends the process; a value the user chose is kept."""
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    process_group.keep_nccl_errors_in_the_rank()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    process_group.keep_nccl_errors_in_the_rank()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


@pytest.mark.parametrize(("version", "code"), [
    ((2, 21, 5), 22105),
    ((2, 27, 3, "+cuda12.8"), 22703),  # torch adds NCCL's suffix when it has one
    (("2", "18", "1"), 21801),
])
def test_nccl_version_as_horovod_numbers_it(version, code):
    from ipydist.torch.horovod.basics import nccl_code

    assert nccl_code(version) == code
