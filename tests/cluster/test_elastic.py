"""``--elastic``: a rank that dies is replaced, and no state is lost (issue 32).

Real ranks under ``mpiexec --with-ft ulfm``: a rank SIGKILLed while the others wait in an
allreduce ends the cell with ``RankDied`` within 5 s; the cluster heals by itself within 10 s of
the kill (a replacement under the dead rank's number, rank 0's variables copied to it); then
every rank holds the survivors' parameters bit for bit, the variables defined before the kill
are there on every rank, and training goes on identically in the next cell. Quiet and under
CPU hogs (``IPYDIST_TEST_TRIALS`` trials each; ``make stress`` runs 10). No process is left.
The tests that heal or rescale share one cluster, each on the state the one before left (a
heal of a healed cluster), with its own model set up again.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

import pytest
from helpers import RANK_COMMAND, TRIALS, cluster_tree, run_cell, wait_gone
from suite_watch import LAUNCHERS

from ipydist.errors import RankDied

NP = 4
#: A model, its DistributedOptimizer and a sampler of this rank's part of the data, trained a
#: few steps before the kill.
SETUP = """
import torch, ipydist.torch as hvd
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters())
X = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
Y = X.sum(1, keepdim=True)
sampler = hvd.shard(torch.utils.data.TensorDataset(X, Y), seed=3)
def train(steps):
    for _ in range(steps):
        idx = list(sampler)[:16]
        opt.zero_grad()
        loss = ((model(X[idx]) - Y[idx]) ** 2).mean()
        loss.backward()
        opt.step()
    return loss.item()
def flat():
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
def same_everywhere(t):
    return bool(hvd.allreduce(t, op=hvd.Max).equal(hvd.allreduce(t, op=hvd.Min)))
train(3)
kept = {"note": "defined before the kill", "step": 3}
"""


#: What a test may leave on the shared cluster that the next one must not meet: process sets
#: (a shrink names the ones it removes) and hvd.elastic states (a heal rolls each back).
RESET = """
import gc
from ipydist.torch.horovod import process_sets as _process_sets
for _set in list(_process_sets._sets.values()):
    hvd.remove_process_set(_set)
for _name in ("state", "resets", "fit", "evens", "low", "spread"):
    globals().pop(_name, None)
gc.collect()
"""

#: The module's 4-rank --elastic cluster, shared by the tests that use :func:`elastic` (each
#: heals or rescales it, and leaves it at 4 healthy ranks or at fewer, which the next one grows
#: back). One start instead of nine: a start is four ranks importing torch (issue 46).
_shared: dict = {}


def _stop_shared() -> None:
    """Stop the shared cluster; then no process of it may be left."""
    session = _shared.pop("session", None)
    if session is None:
        return
    tree = cluster_tree(session)
    session.stop(quiet=True)
    left = {pid: tree[pid] for pid in wait_gone(tree, 10)}
    assert not left, f"processes left after stopping: {left}"


@pytest.fixture(scope="module", autouse=True)
def _shared_elastic_cluster_stops_at_the_end():
    yield
    _stop_shared()


@pytest.fixture
def elastic(shell, magics, no_cluster):
    """The shared 4-rank --elastic cluster (:data:`_shared`; started again if a test left it
    broken), reset (:data:`RESET`) and with SETUP run again. After the test: no process of a
    rank that died or left is still running (the cluster's own checked when it stops)."""
    session = _shared.get("session")
    if session is not None:
        magics.session = session
        try:
            if death := session.death_report():
                raise RuntimeError(death)
            session.run(RESET)
            if session.size != NP:
                shell.run_cell(f"%dist_scale --np {NP}").raise_error()
        except Exception as e:  # left broken by a failed test: a fresh one
            print(f"the shared elastic cluster is started again: {e}", file=sys.__stderr__)
            magics.session = None
            _stop_shared()
            session = None
    if session is None:
        result = shell.run_cell(f"%dist_start --np {NP} --elastic --spares 0")
        result.raise_error()
        session = _shared["session"] = magics.session
    session.run(SETUP)
    yield session
    magics.session = None  # set aside for the next test, not stopped
    try:
        session.healed()  # a test that failed right after a kill: the heal may be under way
    except Exception as e:
        print(f"the shared elastic cluster's heal failed: {e}", file=sys.__stderr__)
    ranks = {pid for r in session.ranks for pid in (r["pid"], r["launched_pid"])}
    gone = {pid: cmd for pid, cmd in cluster_tree(session).items()
            if RANK_COMMAND in cmd and pid not in ranks and not _launcher(cmd)}
    left = {pid: gone[pid] for pid in wait_gone(gone, 10)}
    assert not left, f"processes of ranks that died or left still run: {left}"


def _launcher(cmd: str) -> bool:
    return os.path.basename(cmd.split(" ", 1)[0]) in LAUNCHERS | {"prted"}


def _kill_mid_allreduce(shell, capsys, session, victim: int) -> tuple[float, float]:
    """SIGKILL ``victim`` (from here, as the out-of-memory killer would) while every rank runs
    allreduces; (when it was killed, when the cell ended), as time.time()."""
    killed = []

    def kill():
        killed.append(time.time())
        os.kill(session.ranks[victim]["pid"], signal.SIGKILL)

    killer = threading.Timer(1.0, kill)
    killer.start()
    result, out, err = run_cell(shell, capsys, """%%everyrank
t = torch.ones(1000)
while True:
    hvd.allreduce_(t)
""")
    ended = time.time()
    killer.join()
    assert isinstance(result.error_in_exec, RankDied), (result.error_in_exec, err)
    message = str(result.error_in_exec)
    assert f"rank {victim} (pid" in message and "being replaced" in message, message
    assert "killed by signal 9 (SIGKILL)" in message, message  # the daemons' log, by its pid
    return killed[0], ended


def _check_healed(shell, capsys, session, victim: int, died: float, old_pids: list[int]):
    """The next cell runs on 4 ranks with everything kept, and trains on identically."""
    result, out, err = run_cell(shell, capsys, """%%everyrank
before = same_everywhere(flat())
loss = train(5)
after = (hvd.size(), hvd.rank(), kept, sampler.rank, before, same_everywhere(flat()),
         hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
""")
    result.raise_error()
    healed = re.search(r"rank \d+ was replaced in ([\d.]+) s", err)
    assert healed, err
    assert [r["rank"] for r in session.ranks] == list(range(NP))
    pids = [r["pid"] for r in session.ranks]
    assert pids[victim] != old_pids[victim]
    assert [p for i, p in enumerate(pids) if i != victim] == \
        [p for i, p in enumerate(old_pids) if i != victim], "a survivor was restarted"
    expected = [(NP, r, {"note": "defined before the kill", "step": 3}, r, True, True, float(NP))
                for r in range(NP)]
    assert session.pull("after") == expected
    return time.time() - died


def _report(line: str) -> None:
    """A measurement for whoever runs the tests (``make stress`` quotes them), past capture."""
    print(f"ipydist-measure: {line}", file=sys.__stderr__, flush=True)


#: Seconds from the kill to the end of the next cell (which waits for the heal): the issue's
#: 10 s, quiet; under CPU hogs 15 s, since the replacement imports torch on busy cores (here
#: 3.7-6.4 s over 10 loaded trials, and CI's machines have run the loaded tests up to 1.6x
#: slower). ``make stress`` prints every trial's figure.
HEALED_WITHIN = {"": 10.0, "loaded: ": 15.0}


def _kill_and_heal(shell, capsys, session, victim: int, label: str) -> None:
    """The bars: the cell ends within 5 s of the kill, the heal and the next cell within
    HEALED_WITHIN."""
    old_pids = [r["pid"] for r in session.ranks]
    died, ended = _kill_mid_allreduce(shell, capsys, session, victim)
    assert ended - died < 5.0, f"the cell ended {ended - died:.2f} s after the kill"
    healed_after = _check_healed(shell, capsys, session, victim, died, old_pids)
    _report(f"{label}cell ended {ended - died:.2f} s after the kill; healed and the next cell "
            f"done {healed_after:.2f} s after it")
    assert healed_after < HEALED_WITHIN[label]


@pytest.mark.alone
@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_killed_rank_is_replaced_and_no_state_is_lost(shell, capsys, elastic, trial):
    _kill_and_heal(shell, capsys, elastic, victim=2, label="")


@pytest.mark.parametrize("trial", range(TRIALS))
def test_under_load_a_killed_rank_is_replaced(shell, capsys, elastic, hogs, trial):
    _kill_and_heal(shell, capsys, elastic, victim=1, label="loaded: ")


def test_scale_4_to_2_to_4_keeps_the_model_and_splits_the_data_anew(shell, capsys, elastic):
    """``%dist_scale``: the ranks that stay keep everything; new ranks get rank 0's state;
    samplers and the DistributedOptimizer follow the size; training stays identical."""
    check = """%%everyrank
before = same_everywhere(flat())
loss = train(3)
now = (hvd.size(), hvd.rank(), kept, sampler.rank, sampler.num_replicas, len(sampler), before,
       same_everywhere(flat()))
"""
    pids = [r["pid"] for r in elastic.ranks]
    for size, kept_pids in ((2, pids[:2]), (4, pids[:2])):
        result, out, err = run_cell(shell, capsys, f"%dist_scale --np {size}")
        result.raise_error()
        assert f"ranks -> {size} in" in err and "every rank kept its state" in err, err
        assert [r["rank"] for r in elastic.ranks] == list(range(size))
        assert [r["pid"] for r in elastic.ranks][:2] == kept_pids
        run_cell(shell, capsys, check)[0].raise_error()
        expected = [(size, r, {"note": "defined before the kill", "step": 3}, r, size,
                     256 // size, True, True) for r in range(size)]
        assert elastic.pull("now") == expected
    # every rank averages over 4 again: the sum of ones averaged is one
    run_cell(shell, capsys, "%everyrank g = opt._prescale * hvd.size()")[0].raise_error()
    assert elastic.pull("g") == [1.0] * NP
    # the two ranks grown together live and die apart: Open MPI ended a spawned job whole, so
    # killing rank 2 killed rank 3 with it, and the heal failed
    pids = [r["pid"] for r in elastic.ranks]
    os.kill(pids[2], signal.SIGKILL)
    time.sleep(0.5)
    result, _, err = run_cell(shell, capsys, "%everyrank n = hvd.allreduce(torch.ones(1)).item()")
    result.raise_error()
    assert "rank 2 (pid" in err and "was replaced in" in err, err
    assert [r["pid"] for r in elastic.ranks][3] == pids[3], "rank 3 died with rank 2"
    assert elastic.pull("n") == [1.0] * NP


#: The learners for slow links and a process set, beside SETUP's model: a replacement must get
#: all of them (a BlockMomentum pickled as a plain SGD lost its block state; a process set
#: missing on the replacement made the next recovery wait forever).
LEARNERS = """
def made():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    return m
m1, m2, m3 = made(), made(), made()
onebit = hvd.DistributedOptimizer(torch.optim.SGD(m1.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=m1.named_parameters(),
                                  compression=hvd.Compression.onebit)
bmuf = hvd.BlockMomentum(torch.optim.SGD(m2.parameters(), lr=0.01), block_steps=3)
psgd = hvd.DistributedOptimizer(torch.optim.SGD(m3.parameters(), lr=0.01, momentum=0.9),
                                compression=hvd.Compression.powersgd(rank=2, start_iter=1))
evens = hvd.add_process_set([0, 2])
gen = torch.Generator().manual_seed(hvd.rank())
def steps(n):
    for _ in range(n):
        for m, o in ((m1, onebit), (m2, bmuf), (m3, psgd)):
            o.zero_grad()
            m(torch.randn(8, 8, generator=gen)).pow(2).mean().backward()
            o.step()
def flats():
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (m1, m2, m3)]
steps(4)  # mid-block: 4 steps of 3-step blocks
"""


def test_one_bit_block_momentum_and_process_sets_live_on_in_the_replacement(shell, capsys,
                                                                            elastic):
    run_cell(shell, capsys, "%%everyrank\n" + LEARNERS)[0].raise_error()
    os.kill(elastic.ranks[2]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    result, _, err = run_cell(shell, capsys, """%%everyrank
# mid-block each rank's own model differs by design; the block's global model may not
synced = [same_everywhere(flats()[0]), same_everywhere(bmuf._blocks[0].global_model),
          int(bmuf._steps_in_block), same_everywhere(flats()[2])]
steps(5)  # to the end of the third block: every rank at its start
trained = [same_everywhere(f) for f in flats()] + [int(bmuf._steps_in_block)]
in_set = (hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, process_set=evens).item()
          if evens.included() else None)
""")
    result.raise_error()
    assert "rank 2 was replaced in" in err, err
    assert elastic.pull("synced") == [[True, True, 1, True]] * NP  # rank 0's block state
    # PowerSGD: the replacement has no Q and the others dropped theirs; all drew one alike
    assert elastic.pull("trained") == [[True, True, True, 0]] * NP
    assert elastic.pull("in_set") == [2.0, None, 2.0, None]
    # a failure in the next cell: the others are released from the learners' collectives,
    # and the recovery (which makes the process set again) completes on every rank
    t0 = time.monotonic()
    result, _, _ = run_cell(shell, capsys, """%%everyrank
if hvd.rank() == 1:
    raise ValueError("bad batch")
steps(3)
""")
    assert "rank 1 raised" in str(result.error_in_exec), result.error_in_exec
    assert time.monotonic() - t0 < 15, "released and recovered"
    run_cell(shell, capsys, "%everyrank ok = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()"
             )[0].raise_error()
    assert elastic.pull("ok") == [float(NP)] * NP


def test_compressions_that_keep_state_follow_a_resize(shell, capsys, elastic):
    """1-bit's stripes and PowerSGD's world follow ``%dist_scale`` (4 -> 3 -> 4): each rank
    keeps its own error feedback, the momentum correction's share follows the new size, and
    the ranks train on identically. (Before, the 1-bit exchange kept the size it was made
    for: the step after a shrink failed on the all-to-all's sizes.)"""
    run_cell(shell, capsys, "%%everyrank\n" + LEARNERS)[0].raise_error()
    for size in (3, NP):
        run_cell(shell, capsys, f"%dist_scale --np {size}")[0].raise_error()
        run_cell(shell, capsys, """%%everyrank
steps(3)  # BMUF's models differ mid-block by design: the other two are compared
after = [same_everywhere(flats()[0]), same_everywhere(flats()[2]),
         onebit._buckets[0].kept.world, psgd._buckets[0].kept.world]
""")[0].raise_error()
        assert elastic.pull("after") == [[True, True, size, size]] * size


def test_shrinking_removes_the_process_sets_of_ranks_that_left(shell, capsys, elastic):
    """The ranks that leave end their process at once after they answered (as a loaded
    machine may make them, their answer still unsent): their end is their answer."""
    run_cell(shell, capsys, """%%everyrank
low, spread = hvd.add_process_set([0, 1]), hvd.add_process_set([1, 3])
import ipydist.rank.healing.heal
ipydist.rank.healing.heal.LEAVE_AFTER_SECONDS = 0
""")[0].raise_error()
    result, _, err = run_cell(shell, capsys, "%dist_scale --np 2")
    result.raise_error()
    assert "removed, as ranks in them left: the process set of ranks 1 and 3" in err, err
    run_cell(shell, capsys, """%%everyrank
got = (hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=low).item(),
       spread.process_set_id)
""")[0].raise_error()
    assert elastic.pull("got") == [(2.0, None)] * 2


#: A replacement cannot start where the ranks' working folder was deleted: MPI's spawn fails
#: at once, on every survivor alike (Open MPI 5.0.11), the failure injected here.
LOSE_THE_FOLDER = """%%everyrank
import os
home = os.getcwd()
os.makedirs(GONE, exist_ok=True)
os.chdir(GONE)
hvd.barrier()
if hvd.rank() == 0:
    os.rmdir(GONE)
hvd.barrier()
"""


def test_when_no_replacement_can_start_the_others_go_on_down_to_min_np(shell, capsys, magics,
                                                                       no_cluster, tmp_path):
    shell.run_cell(f"%dist_start --np {NP} --elastic --spares 0 --min-np 2").raise_error()
    session = magics.session
    try:
        session.run(SETUP)
        session.push(GONE=str(tmp_path / "deleted"))
        run_cell(shell, capsys, LOSE_THE_FOLDER)[0].raise_error()
        old = [r["pid"] for r in session.ranks]
        os.kill(old[1], signal.SIGKILL)
        time.sleep(0.5)
        result, _, err = run_cell(shell, capsys, """%%everyrank
os.chdir(home)
before = same_everywhere(flat())
loss = train(3)
after = (hvd.size(), hvd.rank(), kept, sampler.rank, sampler.num_replicas, before,
         same_everywhere(flat()))
""")
        result.raise_error()
        assert "rank 1 could not be replaced (MPI could not start a replacement" in err, err
        assert "the cluster goes on with 3 ranks (--min-np 2): ranks 2-3 are now ranks 1-2" \
            in err and "samplers now split the data 3 ways: sampler" in err, err
        assert "%dist_scale --np 4 starts it again" in err, err
        assert [r["pid"] for r in session.ranks] == [old[0], old[2], old[3]]
        kept = {"note": "defined before the kill", "step": 3}
        assert session.pull("after") == [(3, r, kept, r, 3, True, True) for r in range(3)]
        # the folder is back (each rank went home): growing again works
        run_cell(shell, capsys, "%dist_scale --np 4")[0].raise_error()
        run_cell(shell, capsys, "%everyrank n = (hvd.size(), same_everywhere(flat()))"
                 )[0].raise_error()
        assert session.pull("n") == [(NP, True)] * NP
    finally:
        session.stop(quiet=True)
        magics.session = None


def test_without_min_np_a_replacement_that_cannot_start_says_to_restart(shell, capsys, magics,
                                                                       no_cluster, tmp_path):
    shell.run_cell("%dist_start --np 2 --elastic --spares 0").raise_error()
    session = magics.session
    try:
        session.run("import torch, ipydist.torch as hvd")
        session.push(GONE=str(tmp_path / "deleted"))
        run_cell(shell, capsys, LOSE_THE_FOLDER)[0].raise_error()
        os.kill(session.ranks[1]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        result, _, _ = run_cell(shell, capsys, "%everyrank 1")
        message = str(result.error_in_exec)
        assert message.startswith("Replacing rank 1 failed (") and \
            "MPI could not start a replacement" in message, message
        assert "--min-np 1 would have let the others go on" in message, message
        assert "run %dist_restart" in message, message
    finally:
        session.stop(quiet=True)
        magics.session = None


def test_min_np_is_checked_before_anything_starts(shell, capsys, magics, no_cluster):
    result, _, _ = run_cell(shell, capsys, f"%dist_start --np {NP} --elastic --min-np 5")
    assert "--min-np 5: more than the 4 ranks to start" in str(result.error_in_exec)
    result, _, _ = run_cell(shell, capsys, f"%dist_start --np {NP} --no-elastic --min-np 2")
    assert "cannot go on without a rank unless it is elastic: leave --no-elastic out" in \
        str(result.error_in_exec)
    assert magics.session is None or not magics.session.running


def test_scale_needs_an_elastic_cluster(shell, capsys, plain_cluster):
    result, _, _ = run_cell(shell, capsys, "%dist_scale --np 2")
    assert "scaling needs an elastic cluster" in str(result.error_in_exec)
    assert "start one with --elastic" in str(result.error_in_exec)
    assert plain_cluster.size == NP and not plain_cluster.elastic


def test_horovod_elastic_state_goes_back_to_its_commit_after_a_heal(shell, capsys, elastic):
    """Horovod's ``hvd.elastic``: after a heal every rank's TorchState is back at its last
    commit (the steps after it undone), synced, and its reset callbacks have run once."""
    run_cell(shell, capsys, """%%everyrank
state = hvd.elastic.TorchState(model, opt, epoch=0)
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])

@hvd.elastic.run
def fit(state, epochs):
    for _ in range(epochs):
        train(2)
        state.epoch += 1
        state.commit()

fit(state, 2)
at_commit = flat().clone()
train(2)  # not committed: undone by the heal
moved = not torch.equal(flat(), at_commit)
""")[0].raise_error()
    assert elastic.pull("moved") == [True] * NP
    _kill_mid_allreduce(shell, capsys, elastic, victim=3)
    result, _, err = run_cell(shell, capsys, """%%everyrank
back = (state.epoch, torch.equal(flat(), at_commit), resets, same_everywhere(flat()))
""")
    result.raise_error()
    assert "1 hvd.elastic state went back to its last commit()" in err, err
    assert elastic.pull("back") == [(2, True, [NP], True)] * NP


def test_a_rank_killed_between_cells_is_replaced_before_the_next_one(shell, capsys, elastic):
    old_pids = [r["pid"] for r in elastic.ranks]
    os.kill(old_pids[2], signal.SIGKILL)
    time.sleep(0.5)
    result, _, err = run_cell(shell, capsys, """%%everyrank
after = (hvd.size(), kept, same_everywhere(flat()))
""")
    result.raise_error()
    assert "rank 2 (pid" in err and "was replaced in" in err, err
    assert elastic.pull("after") == [(NP, {"note": "defined before the kill", "step": 3}, True)
                                     ] * NP
    assert [r["pid"] for r in elastic.ranks][:2] == old_pids[:2]
    # the tensors went through /dev/shm (one host), and the file is gone
    from ipydist.rank.healing import state_transfer

    if os.path.isdir(state_transfer.SHARED_MEMORY):
        left = [n for n in os.listdir(state_transfer.SHARED_MEMORY)
                if n.startswith(f"{state_transfer.FILE_PREFIX}{old_pids[0]}-")]
        assert left == [], left


def test_a_rank_is_replaced_when_every_slot_was_taken(shell, capsys, magics, no_cluster):
    """2 ranks on 2 cores start without oversubscribing, and mpiexec counts the dead rank's
    slot as taken: the replacement still starts (it was refused: "All nodes which are
    allocated for this job are already filled")."""
    cores = os.cpu_count() or 1
    shell.run_cell(f"%dist_start --np {min(cores, 2)} --elastic --spares 0").raise_error()
    session = magics.session
    try:
        session.run("import torch, ipydist.torch as hvd\nx = 5")
        victim = session.size - 1
        os.kill(session.ranks[victim]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        result, _, err = run_cell(shell, capsys, "%everyrank y = (hvd.size(), x)")
        result.raise_error()
        assert "was replaced in" in err, err
        assert session.pull("y") == [(session.size, 5)] * session.size
    finally:
        session.stop(quiet=True)
        magics.session = None
