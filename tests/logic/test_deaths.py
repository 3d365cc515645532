"""How a rank died under ``--elastic``: mpiexec keeps the job and says nothing, so the cause is
read from its daemons' logging of their children's ends, by pid (lines as Open MPI 5.0.11's
PRRTE prints them at ``odls_base_verbose 5``)."""

from __future__ import annotations

import time

from ipydist.notebook.launch import deaths
from ipydist.protocol import RankInfo

LOG = """\
[vm:07239] [prterun-vm-7239@0,0] odls:constructing child list
[vm:07239] [prterun-vm-7239@0,0] local:launch
[vm:07239] [prterun-vm-7239@0,0] hwloc:set on child [prterun-vm-7239@1,1] cpuset 1
[vm:07239] [prterun-vm-7239@0,0] odls:wait_local_proc child process [prterun-vm-7239@1,1] pid 7243 terminated
[vm:07239] [prterun-vm-7239@0,0] odls:waitpid_fired child process [prterun-vm-7239@1,1] terminated with signal Killed
[vm:07239] [prterun-vm-7239@0,0] odls:wait_local_proc child process [prterun-vm-7239@2,0] pid 7300 terminated
[vm:07239] [prterun-vm-7239@0,0] odls:waitpid_fired child process [prterun-vm-7239@2,0] terminated with signal Segmentation fault
[vm:07239] [prterun-vm-7239@0,0] odls:wait_local_proc child process [prterun-vm-7239@1,3] pid 7245 terminated
[vm:07239] [prterun-vm-7239@0,0] odls:waitpid_fired child [prterun-vm-7239@1,3] exit code 3
[vm:07239] [prterun-vm-7239@0,0] odls:waitpid_fired child process [prterun-vm-7239@1,3] terminated normally
"""  # noqa: E501

RANKS = [RankInfo(rank=r, size=4, pid=pid, host="vm") for r, pid in
         [(0, 7242), (1, 7243), (2, 7300), (3, 7245)]]


def test_each_dead_pid_gets_its_own_signal_or_exit_code():
    ends = deaths.child_ends(LOG)
    assert ends[7243].signal == 9 and ends[7300].signal == 11
    assert ends[7245].exit_code == 3 and ends[7245].signal is None
    assert 7242 not in ends  # still running: nothing logged


def test_the_elastic_message_names_each_rank_s_cause():
    text = deaths.describe_death(LOG, [RANKS[1], RANKS[2]], "%dist_restart", healing=True)
    assert text.startswith(
        "rank 1 (pid 7243 on vm) died: killed by signal 9 (SIGKILL); the out-of-memory killer "
        "sends this one too; rank 2 (pid 7300 on vm) died: killed by signal 11 (SIGSEGV), a "
        "segmentation fault. The other ranks keep their state: ranks 1-2 are being replaced"), text
    # a pid the daemons did not log (another host whose log is lost): no cause, no guess
    assert deaths.describe_death("", [RANKS[3]], "%dist_restart", healing=True).startswith(
        "rank 3 (pid 7245 on vm) died. The other ranks")


def test_the_logging_is_kept_out_of_what_a_failed_launch_shows():
    kept = [ln for ln in LOG.splitlines() if not deaths.is_child_end_logging(ln)]
    assert kept == []
    assert not deaths.is_child_end_logging("prterun noticed that process rank 2 with PID 1 ...")


def test_the_report_waits_for_the_end_of_a_rank_here_and_not_for_one_elsewhere():
    # the daemons log rank 1's end on the third look: the report waits for it
    looks = iter(["", LOG.splitlines()[0], LOG])
    read = lambda: next(looks, LOG)  # noqa: E731
    assert deaths.output_with_ends(read, [RANKS[1]], lambda info: True) == LOG
    # a rank on another host: its daemon's log never comes here, so none is waited for
    t0 = time.monotonic()
    assert deaths.output_with_ends(lambda: "", [RANKS[3]], lambda info: False) == ""
    assert time.monotonic() - t0 < 0.5
    # a rank here whose end is never logged: the report goes on after the wait
    t0 = time.monotonic()
    assert deaths.output_with_ends(lambda: "", [RANKS[3]], lambda info: True, wait=0.3) == ""
    assert 0.3 <= time.monotonic() - t0 < 2


def test_a_crash_backtrace_keeps_its_signal_and_innermost_frames_in_a_launch_message():
    from ipydist.notebook.launch import mpiexec

    crash = ["[node2:00020] *** Process received signal ***",
             "[node2:00020] Signal: Segmentation fault (11)",
             *(f"[node2:00020] [{i:2d}] /lib/libfoo.so(+0x{i:x})[0x7f{i:x}]" for i in range(30)),
             "[node2:00020] *** End of error message ***",
             "srun: error: node2: task 2: Segmentation fault"]
    short = deaths.shorter_backtraces(crash)
    assert short[:3] == crash[:3] and short[11] == crash[11]  # the signal, frames 0 to 9
    assert short[12:] == ["[node2:00020] ... and 20 more frames", *crash[-2:]]
    message = mpiexec.describe_failure("salloc exited", "\n".join(crash), 14, "salloc")
    assert "Signal: Segmentation fault (11)" in message and "[ 0] /lib/libfoo.so" in message
    # a backtrace at the very end of the output is cut too
    assert deaths.shorter_backtraces(crash[:20])[-1] == "[node2:00020] ... and 8 more frames"


def test_only_a_crash_inside_mpi_init_counts_as_mpi_s_own_race():
    # as Open MPI 5.0.11 printed it under srun (tests/hosts/test_slurm_launch.py, beside hogs)
    race = """salloc: Granted job allocation 5
[node1:00309] *** Process received signal ***
[node1:00309] Signal: Segmentation fault (11)
[node1:00309] Signal code: Address not mapped (1)
[node1:00309] Failing at address: 0xe0
[node1:00309] [ 0] /lib/x86_64-linux-gnu/libc.so.6(+0x3c050)[0x7f7c2c65a050]
[node1:00309] [ 1] /v/lib/libmpi.so.40(mca_pml_ob1_recv_frag_callback_match+0x95)[0x7f7c2ae78f25]
[node1:00309] [ 8] /v/lib/libopen-pal.so.80(opal_progress+0x84)[0x7f7c2b019ab4]
[node1:00309] [ 9] /v/lib/libmpi.so.40(ompi_mpi_init+0x425)[0x7f7c2ac91215]
[node1:00309] *** End of error message ***
srun: error: node1: task 0: Segmentation fault"""
    assert deaths.crashed_in_mpi_init(race)
    in_torch = race.replace("ompi_mpi_init+0x425", "at::native::add+0x10")
    assert not deaths.crashed_in_mpi_init(in_torch)  # a crash of the rank's own code
    assert not deaths.crashed_in_mpi_init("srun: error: node1: task 0: Segmentation fault")
    assert not deaths.crashed_in_mpi_init("ipydist: rank 0 on vm: ompi_mpi_init failed")
