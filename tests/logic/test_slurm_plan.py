"""``--launcher slurm``'s rules, without Slurm: the srun and salloc command lines, what is refused
and how it is said, salloc's job lines, srun's report of a rank that died, the allocation's tasks
seen from inside one of its steps. The real launch, against slurmctld and slurmds, is in
tests/hosts/test_slurm_launch.py."""

from __future__ import annotations

import subprocess

import pytest

from ipydist.notebook.launch import deaths, hosts, slurm
from ipydist.notebook.launch.startup import StartWatch
from ipydist.protocol import RankInfo
from ipydist.specs import SpecError, parse_launcher

ALLOCATION = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "node[1-2]",
              "SLURM_TASKS_PER_NODE": "2(x2)"}


@pytest.fixture(autouse=True)
def slurm_on_path(monkeypatch):
    """Slurm's commands by name: what they would be on a login node."""
    monkeypatch.setattr(slurm, "find", lambda name: f"/usr/bin/{name}")


def test_inside_an_allocation_the_ranks_are_one_srun_step_with_the_mpi_plugin():
    command, args = slurm.commands(4, "openmpi", slurm.Request(args=["--cpu-bind=none"]),
                                   ALLOCATION)
    assert command == ["/usr/bin/srun"]
    assert args == ["--mpi=pmix", "--kill-on-bad-exit=1", "--export=ALL", "--cpu-bind=none"]
    _, args = slurm.commands(4, "mpich", slurm.Request(), ALLOCATION)
    assert args[0] == "--mpi=pmi2"
    _, args = slurm.commands(4, "openmpi", slurm.Request(), {**ALLOCATION,
                                                             "SLURM_MPI_TYPE": "pmix_v4"})
    assert not any(a.startswith("--mpi") for a in args), "the site's SLURM_MPI_TYPE is kept"


def test_from_inside_a_job_step_the_ranks_step_gets_none_of_that_steps_layout():
    """JupyterLab started by ``srun -N1 -n1``: srun left its one task's layout in the
    environment, which the ranks' srun would read as its own options."""
    step = {**ALLOCATION, "SLURM_STEP_ID": "0", "SLURM_DISTRIBUTION": "cyclic",
            "SLURM_NTASKS": "1", "SLURM_TASKS_PER_NODE": "1"}
    command, args = slurm.commands(4, "openmpi", slurm.Request(), step)
    assert command[0].endswith("env") and command[-1] == "/usr/bin/srun"
    assert command[1:-1] == ["-u", "SLURM_DISTRIBUTION", "-u", "SLURM_NTASKS", "-u",
                             "SLURM_TASKS_PER_NODE"]
    # JupyterLab's step holds a CPU of the allocation for as long as it runs
    assert "--overlap" in args
    _, args = slurm.commands(4, "openmpi", slurm.Request(args=["--exclusive"]), step)
    assert "--overlap" not in args, "the user's choice"
    _, args = slurm.commands(4, "openmpi", slurm.Request(), ALLOCATION)
    assert "--overlap" not in args and "--exclusive" not in args
    # the start line names srun, not the env in front of it
    plan = slurm.plan(4, "openmpi", slurm.Request(), {}, None, env=step)
    assert plan.command[0].endswith("env") and plan.command_name == "srun"
    assert plan.mpiexec == "/usr/bin/srun"


def test_outside_an_allocation_salloc_asks_for_the_tasks_and_runs_srun():
    request = slurm.Request("gpu", "1:00:00", "proj", ["--nodes=2"])
    command, args = slurm.commands(8, "openmpi", request, {})
    assert command == ["/usr/bin/salloc", "--ntasks=8", "--partition=gpu", "--time=1:00:00",
                       "--account=proj", "--job-name=ipydist", "--nodes=2", "/usr/bin/srun"]
    assert args[0] == "--mpi=pmix"
    command, _ = slurm.commands(2, "openmpi", slurm.Request(args=["-J", "mine"]), {})
    assert "--job-name=ipydist" not in command


def test_the_plan_keeps_one_host_on_loopback_and_names_the_launch():
    plan = slurm.plan(2, "openmpi", slurm.Request(), {"A": "1"}, None, env={})
    assert plan.command_name == "salloc" and plan.allocates and not plan.multi_host
    assert plan.env == {"A": "1", "GLOO_SOCKET_IFNAME": "lo", "OMPI_MCA_btl": "self,sm",
                        "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3",
                        "IPYDIST_FORKSERVER": "0"}  # srun's tasks are the ranks themselves
    assert slurm.plan(2, "openmpi", slurm.Request(), {"IPYDIST_FORKSERVER": "a"}, None,
                      env={}).env["IPYDIST_FORKSERVER"] == "a", "--env wins"
    assert plan.title == "Slurm (salloc, then srun)"
    inside = slurm.plan(2, "openmpi", slurm.Request(), {}, None, env=ALLOCATION)
    assert inside.command_name == "srun" and not inside.allocates
    assert inside.title == "Slurm (srun in job 12)"
    assert "--partition" in inside.hint


@pytest.mark.parametrize("kwargs, mpiexec_options, env, words", [
    ({"partition": "gpu"}, [], {}, "--partition: these ask Slurm for the ranks; add "
     "--launcher slurm."),
    ({"args": ["--nodes=2"]}, [], {}, "--slurm-args: these ask Slurm"),
    ({}, ["--hosts"], {}, "--hosts: with --launcher slurm, Slurm places the ranks"),
    ({"time": "10"}, [], ALLOCATION, "--time: this notebook runs inside Slurm job 12"),
])
def test_options_that_do_not_fit_are_refused_with_what_to_do(kwargs, mpiexec_options, env,
                                                             words):
    launcher = "mpiexec" if "these ask Slurm" in words else "slurm"
    with pytest.raises(SpecError) as e:
        slurm.check_request(slurm.Request(**kwargs), launcher, mpiexec_options, env)
    assert words in str(e.value)


def test_launcher_names_and_counts_are_checked():
    with pytest.raises(SpecError, match="--launcher srun: expected mpiexec"):
        parse_launcher("srun")
    assert slurm.ranks_and_hosts(None, slurm.Request(), ALLOCATION | {"SLURM_JOB_NODELIST":
                                                                      "localhost",
                                                                      "SLURM_TASKS_PER_NODE":
                                                                      "3"})[0] == 3
    with pytest.raises(SpecError, match="Slurm job 12 has 3 tasks"):
        slurm.ranks_and_hosts(4, slurm.Request(), ALLOCATION | {
            "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "3"})
    with pytest.raises(SpecError, match="give --np, the number of ranks"):
        slurm.ranks_and_hosts(None, slurm.Request(), {})


def test_sallocs_job_lines_are_read_as_they_come():
    assert slurm.allocation_in("salloc: Pending job allocation 31\n") == ("31", False)
    assert slurm.allocation_in("salloc: Pending job allocation 31\nsalloc: job 31 queued and "
                               "waiting for resources\nsalloc: Granted job allocation 31\n") \
        == ("31", True)
    assert slurm.allocation_in("torch imported\n") == (None, False)


def test_the_start_line_shows_the_slurm_job(tmp_path):
    out = tmp_path / "out"
    w = StartWatch(2, "Starting 2 ranks with Slurm", init=True, started=0.0, live=True,
                   launcher="salloc")
    assert w.so_far() == "launching salloc"
    w.launched(now=0.1)
    out.write_text("salloc: Pending job allocation 7\n")
    w.read(str(out), now=0.2)
    assert w.so_far().startswith("salloc launched · Slurm job 7 pending (waiting for nodes) · ")
    out.write_text("salloc: Pending job allocation 7\nsalloc: Granted job allocation 7\n")
    w.read(str(out), now=0.3)
    assert "Slurm job 7 granted · torch imported 0/2" in w.text(now=0.4)


def test_a_rank_that_srun_saw_die_is_named_with_its_signal():
    dead = [RankInfo(rank=r, size=4, pid=100 + r, host="node2") for r in (2, 3)]
    output = ("srun: error: node2: task 3: Killed\nsrun: Terminating StepId=12.0\n"
              "srun: error: node2: task 2: Terminated\n")
    text = deaths.describe_death(output, dead, "%dist_restart", "srun")
    assert text.startswith("rank 3 (pid 103 on node2) died: killed by signal 9 (SIGKILL)")
    assert "srun then stopped rank 2." in text


def test_the_magic_takes_the_slurm_options_and_refuses_them_without_the_launcher(idle_shell):
    shell = idle_shell
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        result = shell.run_cell("%dist_start --np 2 --partition debug --time 10")
    text = str(result.error_in_exec or "") + captured.stderr
    assert "--partition and --time: these ask Slurm for the ranks; add --launcher slurm." in text
    with capture_output() as captured:
        result = shell.run_cell("%dist_start --launcher sbatch")
    text = str(result.error_in_exec or "") + captured.stderr
    assert "--launcher sbatch: expected mpiexec" in text


@pytest.mark.parametrize("shown, cpus, expected", [
    # salloc -N2 -n4 on nodes of 2 CPUs, as scontrol 22.05 writes it with --oneliner
    ("JobId=1 NumNodes=2 NumCPUs=4 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
     "NtasksPerN:B:S:C=0:0:*:*", "2(x2)", [2, 2]),
    ("NumTasks=3 CPUs/Task=1", "2,1", [2, 1]),
    # whole nodes of 64 CPUs: the tasks, not the CPUs
    ("NumTasks=8 CPUs/Task=1 NtasksPerN:B:S:C=0:0:*:*", "64(x2)", [4, 4]),
    ("NumTasks=8 CPUs/Task=1 NtasksPerN:B:S:C=4:0:*:*", "64(x2)", [4, 4]),
    ("NumTasks=4 CPUs/Task=2", "4(x2)", [2, 2]),
    ("NumTasks=5 CPUs/Task=1", "4,1", [4, 1]),
    ("", "2(x2)", [2, 2]),  # no answer from scontrol: what the CPUs hold
])
def test_inside_a_job_step_the_allocations_tasks_come_from_the_job(shown, cpus, expected):
    assert hosts.tasks_in_job(shown, cpus, 2) == expected


def test_a_job_steps_own_tasks_per_node_are_not_taken_for_the_allocations(monkeypatch):
    """JupyterLab started by ``srun -N1 -n1`` in ``salloc -N2 -n4``: SLURM_TASKS_PER_NODE is
    the step's 1, the allocation's 2 a node are asked of scontrol."""
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_TASKS_PER_NODE": "1",
           "SLURM_JOB_CPUS_PER_NODE": "2(x2)"}
    assert hosts.allocation_tasks(env, 2) == [1, 1]  # a batch script's: the variable says
    asked = []

    def scontrol(argv, **kw):
        asked.append(argv[1:])
        return subprocess.CompletedProcess(argv, 0, "JobId=7 NumTasks=4 CPUs/Task=1", "")

    monkeypatch.setattr(hosts.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(hosts.subprocess, "run", scontrol)
    assert hosts.allocation_tasks({**env, "SLURM_STEP_ID": "0"}, 2) == [2, 2]
    assert asked == [["show", "job", "--oneliner", "7"]]
