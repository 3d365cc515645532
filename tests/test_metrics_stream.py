"""hvd.log() on real ranks reaches the notebook: every point once, in order, per rank."""

from __future__ import annotations

from conftest import NP, run_cell

import ipydist


def test_log_streams_rank0_metrics_and_every_ranks_step_gaps(shell, capsys, cluster):
    before = len(cluster.metrics.points)
    result, _, err = run_cell(shell, capsys, """%%everyrank
import time, ipydist.torch as hvd
for i in range(1000):
    hvd.log(step=i, total=1000, loss=1.0 / (i + 1))
    if i % 100 == 0:
        time.sleep(0.05)
""")
    assert result.error_in_exec is None, err
    points = cluster.metrics.points[before:]
    for r in range(NP):
        steps = [p["step"] for p in points if p["rank"] == r]
        assert steps == list(range(1000)), f"rank {r}: lost, repeated or reordered points"
    rank0 = [p for p in points if p["rank"] == 0]
    assert rank0[-1]["loss"] == 1.0 / 1000 and rank0[0]["total"] == 1000
    assert all("loss" not in p for p in points if p["rank"] != 0)
    assert all(p["gap"] is None or p["gap"] >= 0 for p in points)
    assert cluster.metrics.missing == {}
    history = ipydist.metrics()
    rows = history.to_dict("records") if hasattr(history, "to_dict") else history
    assert len(rows) == len(cluster.metrics.points)


def test_log_mean_reduces_over_ranks(shell, capsys, cluster):
    before = len(cluster.metrics.points)
    result, _, err = run_cell(
        shell, capsys, "%everyrank hvd.log(step=0, reduce='mean', acc=float(hvd.rank()))"
    )
    assert result.error_in_exec is None, err
    rank0 = [p for p in cluster.metrics.points[before:] if p["rank"] == 0]
    assert rank0[-1]["acc"] == sum(range(NP)) / NP
