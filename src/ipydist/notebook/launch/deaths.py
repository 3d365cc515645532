"""How a rank died, read from what its launcher printed: mpiexec (Open MPI's or MPICH's) or
srun names the rank that died first and its signal or exit code. Under ``--elastic`` mpiexec
keeps the job and says nothing of the death, so its daemons are asked to log their children's
ends (:data:`CHILD_END_LOGGING`), which are read here by the dead process's pid.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ipydist.protocol import RankInfo
from ipydist.specs import describe_ranks

#: OpenMPI: "prterun noticed that process rank 2 with PID 1234 on node a exited on signal 9
#: (Killed)." MPICH: "... PID 1234 RUNNING AT a ... KILLED BY SIGNAL: 9 (Killed)".
_OMPI_DEATH = re.compile(
    r"process rank (\d+) with PID (\d+) on\s+node (\S+) exited on\s+signal (\d+)", re.IGNORECASE
)
_MPICH_DEATH = re.compile(r"PID (\d+) RUNNING AT (\S+).*?KILLED BY SIGNAL: (\d+)", re.DOTALL)
#: Slurm's srun: "srun: error: node2: task 3: Killed" (the first task to end badly).
_SRUN_DEATH = re.compile(r"srun: error: (\S+): tasks? (\d+)[-,\d]*: ([A-Z][a-z]+(?: [a-z]+)*)")
_SRUN_SIGNALS = {"Killed": signal.SIGKILL, "Terminated": signal.SIGTERM,
                 "Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT}


#: MPICH's mpiexec.gforker (``-exitinfo``), a line per rank once every rank has ended:
#: "[0]2:Return code = 0, signaled with Killed", "[0]1:Return code = 3". The first death is
#: among the ranks found dead before the job was ended (``describe_death``'s ``first``);
#: gforker's own signals to the others are never it.
_GFORKER_END = re.compile(r"^\[\d+\](\d+):Return code = (\d+)(?:, signaled with (.+?))?\s*$",
                          re.MULTILINE)
_GFORKER_ENDED_BY_IT = {"Interrupt", "Terminated", "Quit"}


#: An exit code instead of a signal. OpenMPI: "Process name: [prterun-a-1@1,2]" then
#: "Exit code:    3"; MPICH: "PID 1234 RUNNING AT a" then "EXIT CODE: 3".
_OMPI_EXIT = re.compile(r"Process name:\s*\[[^\]]*?,(\d+)\]\s*Exit code:\s*(\d+)", re.IGNORECASE)
_MPICH_EXIT = re.compile(r"PID (\d+) RUNNING AT \S+\s*=?\s*EXIT CODE: (\d+)")


#: Under ``--elastic`` mpiexec reports no death (the job goes on); its daemons log each
#: child's end at this verbosity (6 lines per rank at its start, 3 at its end):
#: "odls:wait_local_proc child process [prterun-a-1@1,2] pid 1234 terminated", then
#: "odls:waitpid_fired child process [prterun-a-1@1,2] terminated with signal Killed" (or
#: "... child [...] exit code 3"). A replacement is in another job (``@2``), so the pid, not
#: the rank, says whose end it is.
CHILD_END_LOGGING = ("odls_base_verbose", "5")
#: The words of a child's end in that logging, as bytes, for a look at raw output.
CHILD_END_MARK = b"odls:waitpid_fired child"
_CHILD_PID = re.compile(r"odls:wait_local_proc child process \[(\S+?)\] pid (\d+) terminated")
_CHILD_END = re.compile(r"odls:waitpid_fired child(?: process)? \[(\S+?)\] "
                        r"(?:terminated with signal (.+?)|exit code (\d+))\s*$", re.MULTILINE)
#: The signal of each text the C library names it by (what the daemons print).
_SIGNAL_BY_TEXT = {signal.strsignal(s): int(s) for s in signal.Signals
                   if signal.strsignal(s)}


def child_ends(output: str) -> dict[int, Death]:
    """pid -> how it ended, from the daemons' logging of their children's ends
    (:data:`CHILD_END_LOGGING`); the Death's rank is -1 (the caller knows it by the pid)."""
    pids = {name: int(pid) for name, pid in _CHILD_PID.findall(output)}
    ends: dict[int, Death] = {}
    for m in _CHILD_END.finditer(output):
        pid = pids.get(m.group(1))
        if pid is None or pid in ends:
            continue
        if m.group(2) is not None:
            sig = _SIGNAL_BY_TEXT.get(m.group(2).strip())
            ends[pid] = Death(-1, signal=sig, words=None if sig else m.group(2).strip().lower())
        elif int(m.group(3)) != 0:
            ends[pid] = Death(-1, exit_code=int(m.group(3)))
        else:
            ends[pid] = Death(-1, words="exited with code 0")
    return ends


#: How long a heal's report waits for the daemons' log of how a rank on this host ended: the
#: notebook sees the process gone at once, mpiexec logs it a moment later (under load, after
#: the report had been made without its cause).
CHILD_END_WAIT_SECONDS = 2.0


def output_with_ends(read: Callable[[], str], dead: list[RankInfo],
                     here: Callable[[RankInfo], bool], wait: float = CHILD_END_WAIT_SECONDS) -> str:
    """``read()`` (the launcher's output) once it holds the end of each rank of ``dead`` that
    ran on this host (``here``), or after ``wait`` seconds. A rank on another host is not
    waited for: its daemon's log is not forwarded."""
    pids = [launched_pid(info) for info in dead if here(info)]
    deadline = time.monotonic() + wait
    output = read()
    while any(pid not in child_ends(output) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
        output = read()
    return output


def launched_pid(info: RankInfo) -> int:
    """The pid under which the launcher knows a rank (what its logs and reports name): the
    process it started, which stands in for a rank forked by the host's fork server."""
    return info.launched_pid or info.pid


def is_child_end_logging(line: str) -> bool:
    """Whether ``line`` is the daemons' logging of :data:`CHILD_END_LOGGING` (not to show)."""
    return "] odls:" in line or ("odls_base_default_fns.c" in line) or (
        "] local:launch" in line) or ("] hwloc:set on child" in line)


#: A frame of the backtrace Open MPI prints for a rank that crashed:
#: "[node2:00020] [14] /lib/libpython3.11.so.1.0(+0x27ba3b)[0x7f0941c7ba3b]" ("[ 3]" below 10).
_FRAME = re.compile(r"^(\[[^\]]+\]) \[ ?(\d+)\] ")
#: The frames of a crash kept in a message: the innermost, where it crashed.
FRAMES_SHOWN = 10


def shorter_backtraces(lines: list[str]) -> list[str]:
    """``lines`` with each crash backtrace cut to its innermost :data:`FRAMES_SHOWN` frames
    and a line saying how many more there were: a message shows a launcher's last lines, and a
    backtrace of 30 frames would push out the signal and the frames that say where a rank
    crashed (they come first; the interpreter's own frames follow)."""
    out: list[str] = []
    more: dict[str, int] = {}  # process -> frames left out, not yet said
    for line in lines:
        frame = _FRAME.match(line)
        if frame and int(frame.group(2)) >= FRAMES_SHOWN:
            more[frame.group(1)] = more.get(frame.group(1), 0) + 1
            continue
        for process, count in more.items():
            out.append(f"{process} ... and {count} more frames")
        more.clear()
        out.append(line)
    out += [f"{process} ... and {count} more frames" for process, count in more.items()]
    return out


#: The functions of Open MPI's startup, as a crash's backtrace names them.
_MPI_INIT_FUNCTIONS = re.compile(r"\b(ompi_mpi_init|ompi_mpi_instance_init|PMPI_Init(_thread)?)\b")
#: Said when a start is tried again after a crash inside MPI's own startup.
CRASHED_IN_MPI_INIT_NOTE = (
    "ipydist: a rank crashed inside MPI_Init, before any of ipydist's or your code ran on it "
    "(Open MPI's race when a peer's first message comes before MPI_COMM_WORLD is set up, "
    "open-mpi/ompi#12495, seen under Slurm's PMIx); starting again, once.")


def crashed_in_mpi_init(output: str) -> bool:
    """Whether a launcher's ``output`` shows a rank that crashed inside Open MPI's MPI_Init
    (a signal, and a backtrace through ``ompi_mpi_init``): a race of MPI's own, which a
    second start does not meet again, unlike a crash that any code of the rank causes."""
    return "*** Process received signal ***" in output and any(
        _FRAME.match(line) and _MPI_INIT_FUNCTIONS.search(line) for line in output.splitlines())


@dataclass(frozen=True)
class Death:
    """The rank that died first and what ended it, as far as the launcher said."""

    rank: int
    signal: int | None = None
    exit_code: int | None = None
    #: srun's words for an end that is not one of the signals it names ("bus error")
    words: str | None = None

    def cause(self) -> str:
        """In a sentence: ``killed by signal 9 (SIGKILL); the out-of-memory killer ...``."""
        if self.signal is not None:
            return _signal_text(self.signal)
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        return self.words or ""

    def short(self) -> str:
        """In a table cell: ``signal 9 (SIGKILL)``, ``exit code 3``, or empty when unknown."""
        if self.signal is not None:
            return f"signal {self.signal} ({_signal_name(self.signal)})"
        if self.exit_code is not None:
            return f"exit code {self.exit_code}"
        return self.words or ""


def find_death(output: str, dead: list[RankInfo]) -> Death | None:
    """Which of the ``dead`` ranks (rank infos) died first and how, from the launcher's
    output (mpiexec's or srun's); the lowest dead rank when the launcher did not say. None
    when no rank is dead."""
    if not dead:
        return None
    by_pid = {launched_pid(info): info.rank for info in dead}
    found: Death | None = None
    if m := _OMPI_DEATH.search(output):
        found = Death(int(m.group(1)), signal=int(m.group(4)))
    elif (m := _MPICH_DEATH.search(output)) and int(m.group(1)) in by_pid:
        found = Death(by_pid[int(m.group(1))], signal=int(m.group(3)))
    elif m := _SRUN_DEATH.search(output):
        sig = _SRUN_SIGNALS.get(m.group(3))
        found = Death(int(m.group(2)), signal=int(sig) if sig else None,
                      words=None if sig else m.group(3).lower())
    elif m := _OMPI_EXIT.search(output):
        found = Death(int(m.group(1)), exit_code=int(m.group(2)))
    elif (m := _MPICH_EXIT.search(output)) and int(m.group(1)) in by_pid:
        found = Death(by_pid[int(m.group(1))], exit_code=int(m.group(2)))
    else:
        found = _gforker_death(output, set(by_pid.values()))
    if found is None or found.rank not in by_pid.values():
        found = Death(min(by_pid.values()))
    return found


def _gforker_death(output: str, dead: set[int]) -> Death | None:
    """How the first of the ``dead`` ranks ended, from gforker's report: the others' ends are
    the job's end (ipydist's or gforker's own signals, :data:`_GFORKER_ENDED_BY_IT`)."""
    for m in _GFORKER_END.finditer(output):
        words, code = m.group(3), int(m.group(2))
        if int(m.group(1)) not in dead or words in _GFORKER_ENDED_BY_IT or (
                words is None and code == 0):
            continue
        sig = _SIGNAL_BY_TEXT.get(words) if words else None
        return Death(int(m.group(1)), signal=sig, exit_code=None if words else code,
                     words=None if sig or not words else words.lower())
    return None


def describe_death(output: str, dead: list[RankInfo], restart: str,
                   launcher: str = "mpiexec", healing: bool = False,
                   first: list[RankInfo] | None = None) -> str:
    """Which rank died and how, from the launcher's report (``dead``: the rank infos found
    gone; ``first``: those found gone before the job was ended, among which the launcher's
    report is looked up); ``restart`` is how the user starts a fresh cluster
    (``%dist_restart``).

    mpiexec (or srun) names the rank that died first and its signal; by the time the notebook
    looks, it has usually ended the other ranks too, so those are reported as stopped by it.
    With ``healing`` (``--elastic``) the others live on, and the dead are being replaced.
    """
    if healing:
        ends = child_ends(output)
        ranks = sorted(info.rank for info in dead)
        text = "; ".join(
            f"rank {info.rank} (pid {info.pid} on {info.host}) died"
            + (f": {end.cause()}" if (end := ends.get(launched_pid(info))) and end.cause() else "")
            for info in sorted(dead, key=lambda i: i.rank))
        one = len(ranks) == 1
        return (f"{text}. The other ranks keep their state: {describe_ranks(ranks)} "
                f"{'is' if one else 'are'} being replaced (--elastic), and the next cell "
                f"waits for {'it' if one else 'them'}.")
    death = find_death(output, first or dead)
    assert death is not None  # it is told of dead ranks only
    infos = {info.rank: info for info in [*(first or []), *dead]}
    info = infos[death.rank]
    text = f"rank {death.rank} (pid {info.pid} on {info.host}) died"
    text += f": {death.cause()}." if death.cause() else "."
    others = sorted(r for r in infos if r != death.rank)
    if others:
        text += f" {launcher} then stopped {describe_ranks(others)}."
    return text + f" Run {restart} to start a fresh cluster with the same arguments."


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _signal_text(num: int) -> str:
    text = f"killed by signal {num} ({_signal_name(num)})"
    if num == signal.SIGKILL:
        text += "; the out-of-memory killer sends this one too"
    elif num == signal.SIGSEGV:
        text += ", a segmentation fault"
    return text
