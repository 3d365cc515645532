"""A real 4-rank cluster driven through the magics: ranks, collectives, output, errors, state."""

from __future__ import annotations

import re
import sys
import time

import pytest
from helpers import NP, as_merged, plain, run_cell
from IPython.core.error import UsageError

from ipydist.errors import RankError


def ok(shell, capsys, code: str):
    result, out, err = run_cell(shell, capsys, code)
    if result.error_in_exec is not None:
        raise AssertionError(f"cell failed: {result.error_in_exec!r}\n{out}\n{err}")
    return result, out, err


def test_each_rank_knows_its_place(shell, capsys, cluster):
    ok(shell, capsys, """%%everyrank
import os, torch, torch.distributed as dist
import ipydist.torch as hvd
hvd.init(); hvd.init()  # idempotent
place = dict(
    rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(), local_size=hvd.local_size(),
    device=str(hvd.device()), backend=dist.get_backend(), dist_rank=dist.get_rank(),
    env={k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                    "MASTER_ADDR", "MASTER_PORT")},
    threads=torch.get_num_threads(),
)
""")
    places = shell.run_line_magic("dist_pull", "place")
    assert [p["rank"] for p in places] == list(range(NP))
    ports = {p["env"]["MASTER_PORT"] for p in places}
    assert ports == {"0"}, "one host: the rendezvous is a private file, no port"
    for r, p in enumerate(places):
        assert p["size"] == NP and p["dist_rank"] == r and p["local_rank"] == r
        assert p["local_size"] == NP and p["device"] == "cpu" and p["backend"] == "gloo"
        assert p["env"]["RANK"] == str(r) and p["env"]["WORLD_SIZE"] == str(NP)
        assert p["env"]["LOCAL_RANK"] == str(r) and p["env"]["LOCAL_WORLD_SIZE"] == str(NP)
        assert p["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert p["threads"] >= 1
    assert [i["rank"] for i in cluster.ranks] == list(range(NP))


def test_the_ranks_say_which_wire_their_collectives_take(cluster):
    assert [info["transport"] for info in cluster.ranks] == ["mpi"] * NP


def test_allreduce_ops(shell, capsys, cluster, transport):
    ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
r = float(hvd.rank())
t = torch.tensor([r, 2 * r])
got = dict(
    sum=hvd.allreduce(t, op=hvd.Sum).tolist(),
    avg=hvd.allreduce(t).tolist(),
    min=hvd.allreduce(t, op=hvd.Min).tolist(),
    max=hvd.allreduce(t, op=hvd.Max).tolist(),
    scaled=hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0).tolist(),
    untouched=t.tolist(),
    int_avg=hvd.allreduce(torch.tensor([hvd.rank()])).tolist(),
)
inplace = torch.ones(3)
same = hvd.allreduce_(inplace, op=hvd.Sum) is inplace
got["inplace"] = inplace.tolist()
got["same"] = same
strided = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: reduced through a copy
hvd.allreduce_(strided, op=hvd.Sum)
got["strided"] = strided.tolist()
got["bf16"] = hvd.allreduce(torch.ones(2, dtype=torch.bfloat16), op=hvd.Sum).tolist()
got["i64"] = hvd.allreduce(torch.tensor([2**40 + hvd.rank()]), op=hvd.Max).tolist()
""")
    total = sum(range(NP))
    for r, got in enumerate(shell.run_line_magic("dist_pull", "got")):
        assert got["sum"] == [total, 2 * total]
        assert got["avg"] == pytest.approx([total / NP, 2 * total / NP])
        assert got["min"] == [0, 0] and got["max"] == [NP - 1, 2 * (NP - 1)]
        assert got["scaled"] == [2 * total, 4 * total]
        assert got["untouched"] == [r, 2 * r], "allreduce must not change its input"
        assert got["int_avg"] == [total // NP]
        assert got["inplace"] == [NP] * 3 and got["same"] is True
        assert got["strided"] == [[NP * v for v in row] for row in [[0, 3], [1, 4], [2, 5]]]
        assert got["bf16"] == [NP, NP], "bfloat16 (no MPI type) takes gloo"
        assert got["i64"] == [2**40 + NP - 1]


def test_allgather_unequal_first_dimension(shell, capsys, cluster, transport):
    ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
mine = torch.full((hvd.rank() + 1, 2), float(hvd.rank()))
gathered = hvd.allgather(mine)
even = hvd.allgather(torch.full((2,), hvd.rank(), dtype=torch.int32))
""")
    expected = [[float(r)] * 2 for r in range(NP) for _ in range(r + 1)]
    for gathered in shell.run_line_magic("dist_pull", "gathered"):
        assert gathered.tolist() == expected
    for even in shell.run_line_magic("dist_pull", "even"):
        assert even.tolist() == [r for r in range(NP) for _ in range(2)]
        assert even.dtype == __import__("torch").int32


def test_broadcast_and_objects(shell, capsys, cluster, transport):
    ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
t = torch.tensor([float(hvd.rank())] * 3)
b = hvd.broadcast(t, root_rank=2)
before = t.clone()
hvd.broadcast_(t, root_rank=1)
obj = hvd.broadcast_object({"from": hvd.rank(), "items": [1, 2]}, root_rank=3)
objs = hvd.allgather_object(("rank", hvd.rank()))
res = dict(b=b.tolist(), before=before.tolist(), t=t.tolist(), obj=obj, objs=objs)
""")
    for r, res in enumerate(shell.run_line_magic("dist_pull", "res")):
        assert res["b"] == [2.0] * 3 and res["before"] == [float(r)] * 3
        assert res["t"] == [1.0] * 3
        assert res["obj"] == {"from": 3, "items": [1, 2]}
        assert res["objs"] == [("rank", i) for i in range(NP)]


def test_broadcast_parameters_and_optimizer_state(shell, capsys, cluster, transport):
    ok(shell, capsys, """%%everyrank
import torch, ipydist.torch as hvd
torch.manual_seed(hvd.rank())  # different weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.9)
if hvd.rank() == 0:  # only rank 0 has momentum buffers
    model(torch.randn(8, 5)).sum().backward(); opt.step()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
state = {k: v.clone() for k, v in model.state_dict().items()}
lr = opt.param_groups[0]["lr"]
momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
torch.manual_seed(100 + hvd.rank())
lin = torch.nn.Linear(3, 3)
hvd.broadcast_parameters(lin.named_parameters(), root_rank=1)
lin_w = lin.weight.detach().clone()
""")
    states = shell.run_line_magic("dist_pull", "state")
    lrs = shell.run_line_magic("dist_pull", "lr")
    momenta = shell.run_line_magic("dist_pull", "momentum")
    lin_ws = shell.run_line_magic("dist_pull", "lin_w")
    for r in range(1, NP):
        for k in states[0]:
            assert states[r][k].equal(states[0][k]), k
        assert all(m.equal(m0) for m, m0 in zip(momenta[r], momenta[0]))
        assert lin_ws[r].equal(lin_ws[1])
    assert lrs == [pytest.approx(0.1)] * NP


def test_output_is_streamed_live_and_tagged(shell, capsys, cluster):
    """The first line reaches the notebook while the cell is still running (a line no other
    rank prints waits up to 1 s for copies, on a loaded machine: the cell runs 4 s)."""
    arrivals: list[tuple[float, str]] = []

    class Recorder:
        def write(self, text):
            arrivals.append((time.monotonic(), text))
            return len(text)

        def flush(self):
            pass

    real = sys.stdout
    sys.stdout = Recorder()
    try:
        result = shell.run_cell("""%%everyrank
import time, ipydist.torch as hvd
print("start on", hvd.rank(), flush=True)
print("same everywhere", flush=True)
time.sleep(4)
print("done")
""")
        ended = time.monotonic()
    finally:
        sys.stdout = real
    assert result.error_in_exec is None
    text = "".join(t for _, t in arrivals)
    for r in range(NP):
        assert f"[rank {r}] start on {r}\n" in text
    assert as_merged(text).count("[all ranks] same everywhere\n") == 1
    assert "[all ranks] done\n" in as_merged(text)
    first = next(t for t, chunk in arrivals if "start on" in chunk)
    assert ended - first > 1.5, "output arrived only when the cell ended"


def test_output_rank0_and_ranks_subset(shell, capsys, cluster):
    _, out, _ = ok(shell, capsys, '%%everyrank --output rank0\nprint("hi from", hvd.rank())')
    assert out.strip() == "[rank 0] hi from 0"
    _, out, _ = ok(shell, capsys, '%%everyrank --ranks 1-2\nprint("on", hvd.rank())')
    assert "[rank 1] on 1" in out and "[rank 2] on 2" in out
    assert "on 0" not in out and "on 3" not in out
    _, out, _ = ok(shell, capsys, '%%everyrank --ranks 0,3\nprint("on", hvd.rank())')
    assert "[rank 0] on 0" in out and "[rank 3] on 3" in out and "on 1" not in out
    _, out, _ = ok(shell, capsys, '%everyrank print("line form", hvd.rank())')
    assert all(f"[rank {r}] line form {r}" in out for r in range(NP))


def test_a_text_progress_bar_keeps_its_rank_tag(shell, capsys, cluster):
    _, out, _ = ok(shell, capsys, """%%everyrank
import sys, time, ipydist.torch as hvd
for i in range(3):
    sys.stdout.write(f"\\rstep {i} on rank {hvd.rank()}")
    sys.stdout.flush()
    time.sleep(0.3)
print()
""")
    # every state shown is tagged and ends in "\\r", so the next overwrites it. A state that
    # was overwritten before the notebook hooked into the cell's output is gone (ipyparallel
    # keeps the text as a terminal would show it), as it would be on a terminal: so each rank
    # shows at least one of its earlier states, not necessarily all of them
    for r in range(NP):
        assert any(f"[rank {r}] step {i} on rank {r}\r" in out for i in (0, 1)), repr(out)
        assert f"[rank {r}] step 2 on rank {r}" in out, repr(out)
    assert not re.search(r"\r(?!\[)", out), f"a redraw without its tag: {out!r}"


def test_last_expression_becomes_out(shell, capsys, cluster):
    result, _, _ = ok(shell, capsys, "%%everyrank\n6 * 7")
    assert repr(result.result) == "42"
    result, out, _ = ok(shell, capsys, "%%everyrank\nhvd.rank() * 10")
    assert result.result is None
    assert all(f"[rank {r}] Out: {10 * r}" in out for r in range(NP))


def test_exception_on_one_rank_names_that_rank(shell, capsys, cluster):
    # far from any rank's own count, which runs ahead of the shell's when the shared cluster has
    # served other files (their cells run with store_history=False: the shell does not count)
    ok(shell, capsys, "%everyrank _count = get_ipython().execution_count")
    number = max(shell.run_line_magic("dist_pull", "_count")) + 40
    shell.execution_count = number
    result, out, err = run_cell(shell, capsys, """%%everyrank
import ipydist.torch as hvd
def inner():
    if hvd.rank() == 1:
        raise ValueError("bad batch on rank one")
    return "fine"
status = inner()
""", store_history=True)
    error = result.error_in_exec
    assert isinstance(error, RankError)
    assert error.ranks == [1]
    assert str(error) == "rank 1 raised in the cell: ValueError: bad batch on rank one"
    rendered = "\n".join(error._render_traceback_())
    assert "--- rank 1 ---" in rendered and "inner()" in rendered
    # the rank's traceback names the cell as the notebook numbers it, not the rank's count
    assert result.execution_count == number and f"Cell In[{number}]" in plain(rendered), rendered
    assert "bad batch on rank one" in out + err, "IPython shows the rank's traceback"
    assert shell.run_line_magic("dist_pull", "status --rank 0") == "fine"
    # the cluster still works after the error
    _, out, _ = ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum))")
    assert f"[all ranks] tensor([{NP}.])" in as_merged(out)


def test_every_rank_numbers_a_cell_alike_after_cells_on_some_ranks(cluster):
    """Requests with no notebook cell of their own (``Session.run`` called twice in one cell,
    or outside a shell): the ranks' own counts ran apart when some ranks ran more of them,
    and a stack named one cell 18 on one rank and 19 on the others."""
    for ranks in ([0], [0], [1, 2]):
        cluster.run("pass", ranks=ranks)
    cluster.run("_count = get_ipython().execution_count")
    counts = cluster.pull("_count")
    assert len(set(counts)) == 1, counts
    assert counts[0] - 1 == cluster.last_cell_number, (counts, cluster.last_cell_number)


def test_same_exception_on_all_ranks_is_shown_once(shell, capsys, cluster):
    result, _, _ = run_cell(shell, capsys, "%%everyrank\nundefined_name")
    error = result.error_in_exec
    assert isinstance(error, RankError) and error.ranks == list(range(NP))
    rendered = "\n".join(error._render_traceback_())
    assert rendered.count("--- rank") == 1
    assert f"(ranks 1-{NP - 1}: the same NameError)" in rendered


def test_syntax_error_runs_nothing(shell, capsys, cluster):
    ok(shell, capsys, "%everyrank counter = 0")
    result, _, _ = run_cell(shell, capsys, "%%everyrank\ncounter += 1\nif True print('x')")
    assert isinstance(result.error_in_exec, UsageError)
    assert "syntax error in the cell, line 2" in str(result.error_in_exec)
    assert "Nothing ran" in str(result.error_in_exec)
    assert shell.run_line_magic("dist_pull", "counter") == [0] * NP


@pytest.mark.parametrize(
    "spec, fragment",
    [("7", f"this cluster has ranks 0-{NP - 1}; 7 does not exist"),
     ("x", "--ranks x: expected a rank (0), a list (0,2) or a range (1-3)"),
     ("3-1", "--ranks 3-1: expected")],
)
def test_bad_ranks(shell, capsys, cluster, spec, fragment):
    result, _, _ = run_cell(shell, capsys, f"%%everyrank --ranks {spec}\nprint(1)")
    assert isinstance(result.error_in_exec, UsageError)
    assert fragment in str(result.error_in_exec)


def test_push_pull_round_trip(shell, capsys, cluster):
    shell.user_ns.update(config={"lr": 0.01, "layers": [64, 10]}, seed=1234)
    ok(shell, capsys, "%dist_push config seed")
    ok(shell, capsys, "%everyrank echoed = (config, seed, hvd.rank())")
    echoed = shell.run_line_magic("dist_pull", "echoed")
    assert echoed == [({"lr": 0.01, "layers": [64, 10]}, 1234, r) for r in range(NP)]
    assert shell.run_line_magic("dist_pull", "echoed --rank 2") == echoed[2]
    result, _, _ = run_cell(shell, capsys, "%dist_push not_defined_here")
    assert "not defined in the notebook: not_defined_here" in str(result.error_in_exec)
    result, _, _ = run_cell(shell, capsys, "%dist_pull never_set")
    assert "'never_set' is not defined on ranks 0-3" in str(result.error_in_exec)


def test_the_magics_session_and_its_ipyparallel_client_are_reachable(shell, capsys, cluster):
    import ipydist

    assert ipydist.magics_session() is cluster
    client = ipydist.magics_session().client
    assert sorted(client.ids) == list(range(cluster.size)), "engine i is rank i"
    run_cell(shell, capsys, "%%everyrank\nimport ipydist.torch as hvd\nfrom_cell = hvd.rank()")
    assert client[:].pull("from_cell", block=True) == list(range(cluster.size))


def test_state_survives_between_cells(shell, capsys, cluster):
    ok(shell, capsys, "%%everyrank\nimport torch\nacc = torch.zeros(1)")
    for _ in range(3):
        ok(shell, capsys, "%%everyrank\nacc += hvd.allreduce(torch.ones(1), op=hvd.Sum)")
    assert [a.item() for a in shell.run_line_magic("dist_pull", "acc")] == [3.0 * NP] * NP


def test_status_table(shell, capsys, cluster):
    table = shell.run_line_magic("dist_status", "")
    text = str(table)
    assert text.splitlines()[0].split() == ["rank", "host", "pid", "device", "state", "memory"]
    rows = [line.split() for line in text.splitlines()[1:1 + NP]]
    assert [int(r[0]) for r in rows] == list(range(NP))
    assert all(r[4] == "idle" and r[5].isdigit() for r in rows)
    assert "<table>" in table._repr_html_()


def test_second_start_changes_nothing(shell, capsys, cluster):
    pids = [i["pid"] for i in cluster.ranks]
    result, _, _ = run_cell(shell, capsys, "%dist_start --np 2")
    assert isinstance(result.error_in_exec, UsageError)
    assert f"a cluster of {NP} ranks is already running" in str(result.error_in_exec)
    assert [i["pid"] for i in cluster.ranks] == pids and cluster.running


def test_user_code_may_init_and_destroy_the_process_group(shell, capsys, cluster):
    """DDP-tutorial style code calls init_process_group itself, and destroys it at the end."""
    _, out, err = ok(shell, capsys, """%%everyrank
import os, torch, torch.distributed as dist, ipydist.torch as hvd
os.environ["MASTER_ADDR"] = "localhost"
dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
t = torch.ones(1); dist.all_reduce(t)
print("reused", t.item())
dist.destroy_process_group()
""")
    assert f"[all ranks] reused {float(NP)}" in as_merged(out)
    assert "keeps the gloo group of 4 ranks that %dist_start made" in err
    _, out, _ = ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum))")
    assert f"[all ranks] tensor([{float(NP):g}.])" in as_merged(out)


def test_init_after_destroy_gets_a_fresh_group_without_a_fixed_port(shell, capsys, cluster):
    """The DDP tutorial's second setup(): its MASTER_PORT need not be free, or even usable."""
    _, out, _ = ok(shell, capsys, """%%everyrank
import os, torch, torch.distributed as dist, ipydist.torch as hvd
dist.destroy_process_group()
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", "1"
dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]))
t = torch.ones(1); dist.all_reduce(t)
print("fresh", t.item(), dist.get_world_size())
dist.destroy_process_group()
""")
    assert f"[all ranks] fresh {float(NP)} {NP}" in as_merged(out)
    _, out, _ = ok(shell, capsys, "%everyrank print(hvd.allreduce(torch.ones(1), op=hvd.Sum))")
    assert f"[all ranks] tensor([{float(NP):g}.])" in as_merged(out)
