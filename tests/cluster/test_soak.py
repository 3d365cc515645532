"""Soak (issue 5): 500 short cells -- output, a collective, a metric, an error now and then --
and the notebook kernel's and the controller's memory grow by no more than 20 MB."""

from __future__ import annotations

import gc

import psutil
from helpers import run_cell, stress

from ipydist.errors import RankError

CELLS = 500
LIMIT_MB = 20

CELL = """%%everyrank
step += 1
t = hvd.allreduce(torch.ones(16))
hvd.log(step=step, loss=1.0 / step)
print(f"cell {step}: {t.sum().item():g}")
"""


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@stress
def test_500_cells_keep_kernel_and_controller_memory_flat(shell, capsys, cluster):
    run_cell(shell, capsys, "%everyrank import torch, ipydist.torch as hvd; step = 0")
    controller = cluster.cluster.controller_pid
    kernel = psutil.Process().pid

    def soak(n):
        for i in range(n):
            failing = i % 50 == 49
            result, out, err = run_cell(shell, capsys, "%everyrank 1 / 0" if failing else CELL)
            if failing:  # the error reaches the notebook, and the next cell runs on
                assert isinstance(result.error_in_exec, RankError), (result.error_in_exec, err)
                assert "ZeroDivisionError" in str(result.error_in_exec)
            else:
                assert result.error_in_exec is None, err
        gc.collect()

    soak(50)  # warm up: caches, first allocations
    before = rss_mb(kernel), rss_mb(controller)
    soak(CELLS)
    after = rss_mb(kernel), rss_mb(controller)
    growth = [a - b for a, b in zip(after, before)]
    print(f"kernel +{growth[0]:.1f} MB, controller +{growth[1]:.1f} MB over {CELLS} cells")
    assert growth[0] <= LIMIT_MB, f"the notebook kernel grew by {growth[0]:.1f} MB"
    assert growth[1] <= LIMIT_MB, f"the controller grew by {growth[1]:.1f} MB"
