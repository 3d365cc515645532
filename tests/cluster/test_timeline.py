"""Horovod's timeline on a real 4-rank cluster: ``hvd.start_timeline`` / ``stop_timeline``
write one Chrome trace with every rank's collectives (their call checks, under Horovod's
``NEGOTIATE_<OP>`` names, their data, and DistributedOptimizer's buckets),
``HOROVOD_TIMELINE`` starts it at ``init``, and ``%dist_timeline`` draws it under the cell
(in the notebook's words: "allreduce call check") and writes the same trace."""

from __future__ import annotations

import json

from helpers import NP, pulled, run_cell, run_ok

from ipydist.notebook.reports.timeline import Timeline


def _names_by_rank(trace: dict) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] > 0
            found.setdefault(e["pid"], set()).add(e["name"])
    return found


def test_start_and_stop_timeline_write_every_ranks_collectives(shell, capsys, cluster,
                                                               transport, tmp_path):
    path = tmp_path / "trace.json"
    run_ok(shell, capsys, f"""%%everyrank
import torch, ipydist.torch as hvd
hvd.start_timeline({str(path)!r})
hvd.allreduce(torch.ones(1000))
hvd.allgather(torch.ones(3))
hvd.broadcast(torch.ones(2), 0)
m = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                               named_parameters=m.named_parameters())
opt.zero_grad()
m(torch.ones(1, 4)).sum().backward()
opt.step()
written = hvd.stop_timeline()
""")
    assert pulled(shell, "written") == [str(path)] + [None] * (NP - 1)
    trace = json.loads(path.read_text())
    names = _names_by_rank(trace)
    assert sorted(names) == list(range(NP))
    for rank_names in names.values():
        assert {"ALLREDUCE", "ALLGATHER", "BROADCAST", "NEGOTIATE_ALLREDUCE",
                "NEGOTIATE_ALLGATHER", "NEGOTIATE_OPTIMIZER_STEP"} <= rank_names, rank_names
    rows = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert rows == [f"rank {r}" for r in range(NP)]
    buckets = [e for e in trace["traceEvents"] if e.get("args", {}).get("bucket")]
    assert buckets and all(e["name"] == "ALLREDUCE" for e in buckets)


def test_horovod_timeline_environment_starts_it_at_init(shell, capsys, cluster, tmp_path):
    path = tmp_path / "from-env.json"
    run_ok(shell, capsys, f"""%%everyrank
import os, torch, ipydist.torch as hvd
from ipydist.torch._core import events
events.path = None  # as in a fresh process
os.environ["HOROVOD_TIMELINE"] = {str(path)!r}
try:
    hvd.init()
    hvd.allreduce(torch.ones(1))
    hvd.stop_timeline()
finally:
    del os.environ["HOROVOD_TIMELINE"]
""")
    assert "ALLREDUCE" in _names_by_rank(json.loads(path.read_text()))[0]


def test_dist_timeline_draws_and_writes_the_trace(shell, capsys, cluster, tmp_path):
    out = tmp_path / "shown.json"
    shell.run_line_magic("dist_timeline", "--start")
    assert "Recording every rank's collectives" in capsys.readouterr().out
    run_ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
for _ in range(3):
    hvd.allreduce(torch.ones(100))
""")
    shown = shell.run_line_magic("dist_timeline", f"--out {out}")
    assert isinstance(shown, Timeline) and shown.path == str(out)
    page = shown._repr_html_()
    assert page.startswith("<svg") and page.count("<rect") >= 2 * 3 * NP
    calls_per_rank = {row.event: row.calls for row in shown.summary()}
    assert calls_per_rank["allreduce"] == calls_per_rank["allreduce call check"] == (3, 3)
    assert "rank 0 call check" in page and "NEGOTIATE_ALLREDUCE" not in page
    assert "allreduce call check" in repr(shown) and str(out) in repr(shown)
    assert sorted(_names_by_rank(json.loads(out.read_text()))) == list(range(NP))
    stopped = shell.run_line_magic("dist_timeline", f"--stop --out {out}")
    assert not stopped.empty
    assert shell.run_line_magic("dist_timeline", f"--out {out}") is None
    assert "No collectives recorded" in capsys.readouterr().out
    result, _, err = run_cell(shell, capsys, "%dist_timeline --start --stop")
    assert "--start and --stop: choose one" in err
