"""The live cluster view's GPU column: a rank on a GPU host reads its own GPU's use and memory
through NVML (the ``nvidia-ml-py`` package, the ``gpu`` extra). Run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

import ipydist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("np", [1, 2])
def test_each_rank_reads_its_gpu_while_it_computes(np):
    """One rank, and 2 ranks sharing GPU 0 (the view's GPU column for each of them)."""
    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    with ipydist.Session(np=np, gpus="0") as s:
        s.run("import torch\n"
              "from ipydist.rank.vitals import Vitals\n"
              "x = torch.randn(4096, 4096, device='cuda')\n"
              "readings = Vitals()\n"
              "for _ in range(50):\n"
              "    x = x @ x / 4096\n"
              "reading = readings.sample({})['gpu']\n"
              "torch.cuda.synchronize()")
        readings = s.pull("reading")
    assert len(readings) == np
    for reading in readings:
        assert 0 <= reading["util"] <= 100, reading
        assert reading["used"] >= 64 * 2**20 and reading["total"] > reading["used"], reading
