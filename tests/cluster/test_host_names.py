"""Naming the hosts ranks run on (``--hosts``, ``--hostfile``, ``--mpi-args``, a Slurm
allocation), and what mpiexec is told for them: pure rules, plus one real start with a named
host. (Ranks on other hosts: test_multihost.py, on network-namespace hosts.)"""

from __future__ import annotations

import pytest
from helpers import plain

from ipydist import protocol
from ipydist.network import Route
from ipydist.notebook.launch import hosts as host_names
from ipydist.notebook.launch import mpiexec
from ipydist.notebook.reports.status import grouped_by_host
from ipydist.protocol import RankInfo
from ipydist.specs import SpecError, format_hosts, parse_hostfile, parse_hosts

ROUTE = Route("198.51.100.1", "veth0", "198.51.100.0/24")


def test_hosts_spec_in_horovods_syntax():
    assert parse_hosts("nodeA:4,nodeB:4") == [("nodeA", 4), ("nodeB", 4)]
    assert parse_hosts("a, b,a:2") == [("a", 3), ("b", 1)], "one slot each, named twice adds"
    assert format_hosts(parse_hosts("nodeA:4,nodeB:2")) == "nodeA:4,nodeB:2"
    for bad in ("a:x", "a:0", ":3", "a b", "a:-1", ""):
        with pytest.raises(SpecError, match="nodeA:4,nodeB:4"):
            parse_hosts(bad)


def test_hostfiles_in_open_mpi_and_mpich_syntax():
    text = ("# the lab's nodes\nnodeA slots=4\nnodeB:2  # MPICH\nnodeC\n\n"
            "nodeD slots=2 max_slots=8\n")
    assert parse_hostfile(text) == [("nodeA", 4), ("nodeB", 2), ("nodeC", 1), ("nodeD", 2)]
    with pytest.raises(SpecError, match=r"line 2: 'b foo=3' is not a host line"):
        parse_hostfile("a\nb foo=3")
    with pytest.raises(SpecError, match="no host in it"):
        parse_hostfile("# nothing\n")


def test_slurm_node_lists_and_tasks_per_node():
    assert host_names.expand_nodelist("node[01-03,07],gpu1,a[1-2]b") == [
        "node01", "node02", "node03", "node07", "gpu1", "a1b", "a2b"]
    assert host_names.expand_tasks("2(x3),1", 4) == [2, 2, 2, 1]
    assert host_names.expand_tasks("", 2) == [1, 1], "missing: one each"
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_TASKS_PER_NODE": "3"}
    named = host_names.choose(env=env)
    assert named.hosts == [("localhost", 3)] and named.source == "Slurm allocation 42"
    assert not named.multi_host, "an allocation of this host alone is one host"
    assert host_names.choose(hosts="localhost:2", env=env).source == "--hosts localhost:2", (
        "hosts named by the user win over the allocation's")


def test_hosts_named_in_mpi_args_and_a_hostfile(tmp_path):
    assert host_names.choose(mpi_args=["--host", "127.0.0.1:2"], env={}).hosts == [
        ("127.0.0.1", 2)]
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    assert host_names.choose(mpi_args=[f"--hostfile={path}"], env={}).hosts == [
        ("localhost", 2)]
    assert host_names.choose(hostfile=str(path), env={}).slots == 2
    assert host_names.choose(env={}) is None, "nothing named: this host alone"
    with pytest.raises(SpecError, match="give one of them"):
        host_names.choose(hosts="a:1", hostfile=str(path), env={})
    with pytest.raises(SpecError, match="cannot read it"):
        host_names.choose(hostfile=str(tmp_path / "missing"), env={})


def test_a_host_that_does_not_resolve_is_named_in_the_error():
    with pytest.raises(Exception, match="cannot reach host no-such-host.invalid"):
        host_names.choose(hosts="no-such-host.invalid:2", env={})


def test_plan_across_hosts_names_them_and_keeps_mpi_to_their_network():
    named = host_names.Hosts([("nodeA", 2), ("nodeB", 2)], "--hosts", ROUTE)
    plan = mpiexec.plan("mpiexec", 4, "", {}, cores=2, flavor="openmpi", is_root=False,
                        hosts=named)
    args = " ".join(plan.args)
    assert "--host nodeA:2,nodeB:2" in args
    assert "--prtemca prte_if_include 198.51.100.0/24" in args
    assert "--mca btl_tcp_if_include 198.51.100.0/24" in args
    assert "btl self,sm" not in args and "--oversubscribe" not in args
    assert plan.multi_host and plan.route == ROUTE
    assert "GLOO_SOCKET_IFNAME" not in plan.env, "each rank picks its own interface"
    assert mpiexec.controller_address(True, ROUTE) == ("198.51.100.1", "198.51.100.1"), (
        "the controller listens on the address that reaches the hosts, not on every one")
    mpich = mpiexec.plan("mpiexec", 4, "", {}, flavor="mpich", is_root=False, hosts=named)
    assert mpich.args[:2] == ["-hosts", "nodeA:2,nodeB:2"]
    mine = mpiexec.plan("mpiexec", 4, "--mca btl_tcp_if_include eth1", {}, flavor="openmpi",
                        is_root=False, hosts=named)
    assert " ".join(mine.args).count("btl_tcp_if_include") == 1, "the user's choice wins"


def test_rank_config_carries_the_notebook_address():
    config = protocol.RankConfig(notebook_addr="198.51.100.1")
    assert protocol.RankConfig.from_env(config.to_env()) == config
    assert protocol.NOTEBOOK_ADDR_ENV not in protocol.RankConfig().to_env()


def test_tables_group_ranks_by_host():
    ranks = [RankInfo(rank=r, size=4, pid=100 + r, host=h)
             for r, h in enumerate(["b", "a", "b", "a"])]
    assert [(i.host, i.rank) for i in grouped_by_host(ranks)] == [
        ("b", 0), ("b", 2), ("a", 1), ("a", 3)]


def test_named_host_start_and_too_few_slots():
    import contextlib
    import io

    from ipydist import Session

    with pytest.raises(SpecError, match="--np 3: --hosts localhost:2 gives 2 slots"):
        Session(np=3, hosts="localhost:2").start()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), Session(hosts="localhost:2") as session:
        session.run("import ipydist.torch as hvd\n"
                    "place = (hvd.cross_rank(), hvd.cross_size(), hvd.local_rank(), "
                    "hvd.local_size())", output="rank0")
        places = session.pull("place")
    assert "2 ranks ready in" in plain(out.getvalue()), "--np defaults to the slots"
    assert places == [(0, 1, 0, 2), (0, 1, 1, 2)]


def test_doctor_hosts_needs_hosts_it_can_reach():
    from ipydist.cli.hostcheck import check_hosts

    [only] = check_hosts("localhost:2", "mpiexec")
    assert only.status == "NOTE" and "only this host" in only.detail
    [bad] = check_hosts("no-such-host.invalid:2", "mpiexec")
    assert bad.status == "FAIL" and "cannot reach host no-such-host.invalid" in bad.detail
