"""The hierarchical allreduce across hosts (issue 36; ipydist/torch/_wire/hierarchy.py): ranks
reduce on their host, then across hosts by stripes, then gather on their host. Two namespace
hosts of 2 ranks each (tests/harness/netns_hosts.py), the notebook's side on a login host.

Every op and dtype ipydist sends over MPI, at sizes below the hierarchy's threshold, above it,
and above the size where a reduction goes in pieces, gives what the flat allreduce gives on
the same ranks, and what arithmetic says; where ``--transport auto`` takes the hierarchy
(ranks dealt out by node) and where it does not (by slot: Open MPI's flat allreduce already
keeps its large exchanges within hosts); and a rank failing while the others wait in a
hierarchical allreduce leaves the next one right.
"""

from __future__ import annotations

import pytest
from login_side import notebook_side
from netns_hosts import unavailable

REASON = unavailable()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


#: On every rank: each op and dtype at each size, by the ranks' own allreduce (hierarchical
#: where they took it), by the flat one (the hierarchy switched off on every rank alike), and
#: as arithmetic says; ``wrong`` lists what differs.
COMPARE = """
import torch, ipydist.torch as hvd
from ipydist.torch._core import topology
from ipydist.torch._wire import hierarchy, transport

rt = topology.get()
SIZES = [1, 7, hierarchy.HIERARCHICAL_FROM // 8 + 3, (transport.SPLIT_ABOVE + (1 << 20)) // 8]
DTYPES = [torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
          torch.int64]
OPS = {"Sum": sum, "Min": min, "Max": max}

def values(rank, n, dtype):
    return ((torch.arange(n) * 7 + rank * 3) % 5 + 1).to(dtype)

def flat(t, op):
    saved = rt.node_data, rt.cross_data
    rt.node_data = rt.cross_data = None
    try:
        return hvd.allreduce(t, op=op)
    finally:
        rt.node_data, rt.cross_data = saved

wrong = []
for n in SIZES:
    for dtype in DTYPES:
        everyone = [values(r, n, dtype) for r in range(hvd.size())]
        mine = values(hvd.rank(), n, dtype)
        for name, combine in OPS.items():
            op = getattr(hvd, name)
            expected = everyone[0].clone()
            for other in everyone[1:]:
                expected = (expected + other if name == "Sum" else
                            torch.minimum(expected, other) if name == "Min" else
                            torch.maximum(expected, other))
            got, reference = hvd.allreduce(mine, op=op), flat(mine, op)
            if not (torch.equal(got, expected) and torch.equal(reference, expected)):
                wrong.append((n, str(dtype), name))
        if dtype.is_floating_point:
            product = hvd.allreduce(mine, op=hvd.Product)
            average = hvd.allreduce(mine, op=hvd.Average)
            if not (torch.equal(product, flat(mine, hvd.Product))
                    and torch.allclose(average, sum(everyone) / hvd.size())):
                wrong.append((n, str(dtype), "Product/Average"))
big = values(hvd.rank(), SIZES[-1], torch.float32)
grouped = hvd.grouped_allreduce([big, big[:SIZES[2]]], op=hvd.Sum)
if not torch.equal(grouped[0], flat(big, hvd.Sum)):
    wrong.append(("grouped", "float32", "Sum"))
"""


def run_compare(hosts, transport="auto", mpi_args=(), compare=True) -> dict:
    return notebook_side(hosts, """
        out["transport"] = [r["transport"] for r in session.ranks]
        out["hosts"] = [r["host"] for r in session.ranks]
        session.run(RANK_CODE, output="rank0")
        out["wrong"] = session.pull("wrong")
    """, rank_code=COMPARE if compare else "wrong = []", transport=transport,
                         mpi_args=mpi_args, timeout=300)


def test_ranks_dealt_out_by_node_reduce_hierarchically_and_match_flat(hosts):
    out = run_compare(hosts, mpi_args=("--map-by", "node"))
    names = [h.name for h in hosts.hosts]
    assert out["hosts"] == names * 2, "rank 0 on node1, 1 on node2, ..."
    assert out["transport"] == ["hierarchical"] * 4, out["transport"]
    assert out["wrong"] == [[]] * 4, out["wrong"]


def test_ranks_by_slot_stay_flat_unless_told_and_forced_hierarchy_matches(hosts):
    assert run_compare(hosts, compare=False)["transport"] == ["mpi"] * 4, (
        "ranks 0-1 and 2-3 on one host each: auto keeps the flat allreduce")
    horovods = run_compare(hosts, mpi_args=("-x", "HOROVOD_HIERARCHICAL_ALLREDUCE=1"),
                           compare=False)
    assert horovods["transport"] == ["hierarchical"] * 4, "Horovod's switch, under auto"
    by_node_told_not = run_compare(hosts, compare=False, mpi_args=(
        "--map-by", "node", "-x", "HOROVOD_HIERARCHICAL_ALLREDUCE=0"))
    assert by_node_told_not["transport"] == ["mpi"] * 4, "Horovod's switch off"
    out = run_compare(hosts, transport="hierarchical")
    assert out["transport"] == ["hierarchical"] * 4, out["transport"]
    assert out["wrong"] == [[]] * 4, out["wrong"]


def test_a_rank_failing_during_a_hierarchical_allreduce_leaves_the_next_right(hosts):
    out = notebook_side(hosts, """
        session.run(RANK_CODE, output="rank0")
        try:
            session.run(
                "if hvd.rank() == 3:\\n"
                "    time.sleep(1)\\n"
                "    raise ValueError('rank 3 fails')\\n"
                "hvd.allreduce_(big, op=hvd.Sum)", output="rank0")
        except Exception as e:
            out["error"] = type(e).__name__
            out["released"] = getattr(e, "released", None)
        session.run("big = torch.ones(1 << 20)\\n"
                    "hvd.allreduce_(big, op=hvd.Sum)\\n"
                    "right = bool((big == hvd.size()).all())", output="rank0")
        out["right"] = session.pull("right")
    """, rank_code="""
        import time, torch, ipydist.torch as hvd
        big = torch.ones(1 << 20)
    """, mpi_args=("--map-by", "node"), timeout=300)
    assert out["error"] == "RankError", out
    assert out["released"] == [0, 1, 2], out
    assert out["right"] == [True] * 4, out
