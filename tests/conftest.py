"""Shared fixtures: a real IPython shell with ipydist loaded, and one 4-rank cluster for the
tests that only need *a* cluster (starting one costs seconds; most tests share it). Helpers that
tests import are in helpers.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import signal_guard
import suite_watch
import worker_turns
from helpers import NP, cluster_processes, run_cell

from ipydist.notebook.launch import kept_forkserver

# The tests press the stop button as IPython's does (``_thread.interrupt_main``), which does
# nothing where SIGINT is ignored: in a shell without job control, a command started in the
# background (``make test &``, nohup) inherits SIGINT ignored. A notebook kernel always has
# Python's handler, so the tests put it back.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal_guard.install()


def pytest_configure(config):
    """Outside pytest-xdist's workers (in its main process, or a run without it): the plugin
    that times the tiers and checks for leftovers at the end (suite_watch.py)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(suite_watch.SuiteWatch(worker_turns.waits),
                                     "ipydist-suite-watch")
        if suite_watch.with_workers(config):
            worker_turns.make_folder()


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        worker_turns.remove_folder()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked ``alone`` runs with no other worker's test beside it (worker_turns.py), and
    so does one that makes its own load (``hogs``): it keeps every core busy anyway, and its
    bars are set for its own load, not for its own and the other workers' together."""
    alone = _is_alone(item)
    keep = alone and nextitem is not None and _is_alone(nextitem)
    with worker_turns.turn(alone=alone, keep=keep):
        yield


def _is_alone(item) -> bool:
    return item.get_closest_marker("alone") is not None or "hogs" in item.fixturenames


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own (see below)
def pytest_collection_modifyitems(config, items):
    """With several workers (``--dist loadgroup``): the long tiers first, and each test in its
    worker group (worker_turns.group_of): a file whole in one worker, the hosts tier all in one.

    pytest-xdist's scheduler reads a test's group from its id (``...::test@group``), which its
    worker sets from the ``xdist_group`` mark by writing ``item._nodeid``; pytest 9.2 reads the
    id from ``item._id``, so the group was lost and a file's tests were dealt to both workers
    (each on its own shared cluster). So the id is set here."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    suite_watch.longest_first(items)
    for item in items:
        group = worker_turns.group_of(item.nodeid)
        item.add_marker(pytest.mark.xdist_group(group))
        if "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{group}")


@pytest.fixture(scope="session")
def shell():
    """The real IPython InteractiveShell that IPython's own tests use, with ipydist loaded."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "ipydist")
    yield ip
    magics = ip.magics_manager.registry["DistMagics"]
    for s in [magics.session, *_parked]:
        if s is not None:
            s.stop(quiet=True)
    kept_forkserver.stop_all()  # as the kernel's exit would: before the suite's leftover check


@pytest.fixture
def magics(shell):
    return shell.magics_manager.registry["DistMagics"]


#: The shared cluster while tests that need none run (:func:`no_cluster`): set aside, still
#: running, and given back to the next test that asks for it. An idle cluster costs no CPU; a
#: restart cost 4 ranks importing torch on 2 cores (about 10 CPU-seconds), and the files that
#: need no cluster sit between files that do (issue 46).
_parked: list = []


#: The attribute that holds the options a shared cluster was started with: a test asks for
#: one kind.
_OPTION = "_suite_start_option"


def _reusable(s, option: str | None = None) -> bool:
    """Whether the shared cluster can serve the next test: running, 4 ranks, started with
    ``option`` (None: any of the shared kinds), none dead, and none still busy with a request
    a failed test left behind (a cell that timed out and did not stop when released), which
    the next test's cells would queue behind: at a run of make test, one such cell failed the
    25 tests after it."""
    return s is not None and s.running and s.size == NP and hasattr(s, _OPTION) \
        and (option is None or getattr(s, _OPTION) == option) \
        and not s.death_report() and not s.cluster.busy_ranks(list(range(s.size)))


def _four_ranks(shell, magics, option: str = ""):
    """A running 4-rank cluster in ``shell``, started with ``option``, reused while it stays
    healthy: one a failed test left with a dead rank is replaced, so that the failure is that
    test's alone (at CI once, a restart that failed after a test killed a rank failed the 90
    tests after it)."""
    s = magics.session
    if not _reusable(s, option):
        if s is not None and s.running:
            s.stop(quiet=True)
        parked = _parked.pop() if _parked else None
        if _reusable(parked, option):
            magics.session = parked
        else:
            if parked is not None and parked.running:
                parked.stop(quiet=True)
            result = shell.run_cell(f"%dist_start --np {NP}{option}")
            result.raise_error()
            setattr(magics.session, _OPTION, option)
    return magics.session


@pytest.fixture
def cluster(shell, magics):
    """A running 4-rank cluster in ``shell``, as ``%dist_start`` makes it on one host (elastic
    with a hot spare, where the MPI has fault tolerance), started once, reused while it stays
    healthy."""
    return _four_ranks(shell, magics)


@pytest.fixture
def plain_cluster(shell, magics):
    """A running 4-rank cluster that is not elastic (``--no-elastic``): a rank that dies ends
    the job, as plain mpiexec (and MPICH, and Slurm's srun) do."""
    return _four_ranks(shell, magics, " --no-elastic")


@pytest.fixture
def no_cluster(shell, magics):
    """The shell with no cluster running, and a snapshot of cluster processes before the test
    (the shared cluster's too, if it is parked: see :data:`_parked`)."""
    s = magics.session
    if _reusable(s) and not _parked:
        _parked.append(s)
    elif s is not None and s.running:
        s.stop(quiet=True)
    magics.session = None
    return set(cluster_processes())


@pytest.fixture(params=["mpi", "gloo"])
def transport(request, shell, capsys, cluster):
    """Each collective test on both wires of CPU tensors: MPI (the default where mpiexec started
    the ranks) and gloo, switched on every rank for the test and back after it."""
    def use(name: str) -> None:
        result, out, err = run_cell(
            shell, capsys, "%everyrank from ipydist.torch._core import topology as _rt; "
                           "from ipydist.torch._wire import transport as _tp"
                           f"; _rt.get().transport = {name!r}; _uses = _tp.uses_mpi(__import__("
                           "'torch').ones(1))")
        assert result.error_in_exec is None, (out, err)
        assert shell.run_line_magic("dist_pull", "_uses") == [name == "mpi"] * NP

    use(request.param)
    yield request.param
    use("mpi")


@pytest.fixture
def hogs():
    """Busy loops on every core, at normal priority, for the length of one test."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(os.cpu_count() or 2)]
    yield procs
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=10)
