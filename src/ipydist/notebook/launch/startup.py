"""Following a start as it happens: mpiexec launched (or a Slurm job granted), torch
imported, process group made, engines registered, with the seconds since the start began.

Until its engine registers, a rank has no channel to the notebook. What the notebook does have
is mpiexec's output, which mpiexec forwards from every host (a marker file in a local folder
would not be seen from other hosts): each rank prints one marker line per step
(:func:`ipydist.protocol.phase_line`), and :class:`StartWatch` reads what was added to that
output a few times a second. Whatever of that output is shown to the user goes through
:func:`as_shown` first.
"""

from __future__ import annotations

import math
import re
import time

from ipydist import protocol
from ipydist.notebook.launch import deaths
from ipydist.notebook.launch.slurm import allocation_in
from ipydist.specs import describe_ranks

#: Seconds between two looks at mpiexec's output (and so between two redraws of the line).
UPDATE_SECONDS = 0.1

_MARKER = protocol.PHASE_MARKER.encode()
#: In salloc's output: "salloc: Pending job allocation 12", "salloc: Granted job allocation 12".
_ALLOCATION = b"job allocation"
_CHILD_END = deaths.CHILD_END_MARK


#: Terminal escape sequences, and control characters other than a line break or a tab: no text
#: a person reads. mpiexec's output can carry them (Open MPI's help messages once ended in a NUL
#: byte, which reached the launch error), as can whatever a rank wrote before it started.
_NOT_TEXT = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x00-\x08\x0b-\x1f\x7f]")


def as_shown(output: str) -> str:
    """mpiexec's output in the form shown to the user: without the ranks' marker lines, and
    without bytes that are not text (a CR LF read as a line break)."""
    output = _NOT_TEXT.sub("", output.replace("\r\n", "\n"))
    if protocol.PHASE_MARKER not in output:
        return output
    return "".join(ln for ln in output.splitlines(True) if protocol.PHASE_MARKER not in ln)


class StartWatch:
    """Which ranks got past which step of a start, and when; the status line that says so.

    ``live``: the line is redrawn in place (a notebook), so it shows the seconds ticking, up to
    ten redraws a second. Otherwise (a terminal) every line shown stays on the screen, so a new
    one is shown only when a step begins or ends.
    """

    def __init__(self, np: int, title: str, init: bool, started: float, live: bool,
                 launcher: str = "mpiexec"):
        self.np = np
        self.launcher = launcher
        self.title = title
        self.live = live
        self.started = started
        self._group = protocol.PHASE_GROUP if init else protocol.PHASE_ENV
        self._labels = {
            protocol.PHASE_TORCH: "torch imported",
            self._group: "process group ready" if init else "torchrun env set",
        }
        #: phase -> {rank: seconds from the start to when the notebook saw the rank past it}
        self.seen: dict[str, dict[int, float]] = {p: {} for p in self._labels}
        self.launched_at: float | None = None
        self.ready_at: float | None = None
        self.registered: list[int] = []
        #: The Slurm job that salloc asked for (None: no salloc), and whether it was granted.
        self.job: str | None = None
        self.granted = False
        #: Whether mpiexec's daemons logged the end of a process they started (under
        #: ``--elastic``, ``deaths.CHILD_END_LOGGING``): the job outlives it, so without this
        #: a rank that died while starting (a crash inside MPI_Init) left the start waiting
        #: for it to the end of ``--timeout``.
        self.rank_ended = False
        self._offset = 0  # how much of mpiexec's output was read
        self._partial = b""  # the last line read, while its newline has not come
        self._looked = -math.inf
        self._shown: list[tuple[str, bool]] | None = None

    # --- what happened -----------------------------------------------------------------------

    def launched(self, now: float | None = None) -> None:
        self.launched_at = self._elapsed(now)

    def look(self, path: str | None, registered: list[int], now: float | None = None) -> None:
        """Take in what happened since the last look: new lines in mpiexec's output file
        (None: no file yet), and the engines registered by now."""
        if path:
            self.read(path, now)
        self.engines(registered, now)

    def read(self, path: str, now: float | None = None) -> None:
        """Take in the marker lines added to mpiexec's output file since the last read."""
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:  # not made yet, or removed by ipyparallel once mpiexec exited
            return
        self._offset += len(data)
        data = self._partial + data
        end = data.rfind(b"\n") + 1
        data, self._partial = data[:end], data[end:]
        if _MARKER in data:
            for line in data.decode(errors="replace").splitlines():
                if found := protocol.parse_phase(line):
                    self.reached(*found, now)
        if _CHILD_END in data:
            self.rank_ended = True
        if _ALLOCATION in data:
            job, granted = allocation_in(data.decode(errors="replace"))
            self.job = job or self.job
            self.granted = self.granted or granted

    def reached(self, rank: int, phase: str, now: float | None = None) -> None:
        """Rank ``rank`` got past ``phase`` (and so past every step before it)."""
        if phase not in self.seen or not 0 <= rank < self.np:
            return
        at = self._elapsed(now)
        for p in self.seen:
            self.seen[p].setdefault(rank, at)
            if p == phase:
                break

    def engines(self, ids: list[int], now: float | None = None) -> None:
        """The engines registered so far (an engine has got past every step of the rank's)."""
        self.registered = sorted(ids)
        for rank in ids:
            self.reached(rank, self._group, now)

    def ready(self, now: float | None = None) -> None:
        self.ready_at = self._elapsed(now)

    # --- showing it --------------------------------------------------------------------------

    def steps(self) -> list[tuple[str, int | None, list[int]]]:
        """(label, count or None, ranks not there yet) of each step to show: those some rank
        got to, and the first that not every rank did (the one the start waits in)."""
        if self.launched_at is None:
            return [(f"launching {self.launcher}", None, [])]
        shown: list[tuple[str, int | None, list[int]]] = [(f"{self.launcher} launched", None, [])]
        if self.job is not None:
            state = "granted" if self.granted else "pending (waiting for nodes)"
            shown.append((f"Slurm job {self.job} {state}", None, []))
        counted = [(self._labels[p], set(ranks)) for p, ranks in self.seen.items()]
        counted.append(("engines registered", set(self.registered)))
        waiting_shown = False
        for label, ranks in counted:
            missing = [r for r in range(self.np) if r not in ranks]
            if ranks or (missing and not waiting_shown):
                shown.append((label, len(ranks), missing))
            waiting_shown = waiting_shown or bool(missing)
        return shown

    def text(self, now: float | None = None) -> str:
        """``Starting 4 ranks with Open MPI · 3.2 s: mpiexec launched · torch imported ·
        process group ready 3/4``: a step every rank got past is shown without its count."""
        parts = [label if not missing else f"{label} {count}/{self.np}"
                 for label, count, missing in self.steps()]
        return f"{self.title} · {self._elapsed(now):.1f} s: {' · '.join(parts)}"

    def so_far(self) -> str:
        """How far the start got, naming the ranks the first unfinished step waits for."""
        parts = []
        for label, count, missing in self.steps():
            if not missing:
                parts.append(label)
            else:
                parts.append(f"{label} {count}/{self.np} (not {describe_ranks(missing)})")
                break
        return " · ".join(parts)

    def show(self, progress, path: str | None, registered: list[int],
             now: float | None = None, force: bool = False) -> None:
        """:meth:`look`, then update ``progress`` (a ``display.Progress``): no more often than
        every UPDATE_SECONDS unless ``force``, and (not ``live``) only when a step began or
        ended."""
        now = time.perf_counter() if now is None else now
        if not force and now - self._looked < UPDATE_SECONDS:
            return
        self._looked = now
        self.look(path, registered, now)
        steps = [(label, bool(missing)) for label, _, missing in self.steps()]
        if self.live or steps != self._shown:
            self._shown = steps
            progress.update(self.text(now))

    def breakdown(self) -> str:
        """The seconds each step took, until its last rank got past it, for the line under
        the start table (empty when a step's end was not seen)."""
        ends = [("launch", self.launched_at)]
        names = {protocol.PHASE_TORCH: "torch import", protocol.PHASE_GROUP: "process group",
                 protocol.PHASE_ENV: "torchrun env"}
        for phase, ranks in self.seen.items():
            ends.append((names[phase], max(ranks.values()) if len(ranks) == self.np else None))
        ends.append(("engine registration", self.ready_at))
        if any(at is None for _, at in ends):
            return ""
        parts, before = [], 0.0
        for name, at in ends:
            assert at is not None  # none is: see above
            parts.append(f"{name} {at - before:.1f} s")
            before = at
        return "Start: " + " · ".join(parts)

    def _elapsed(self, now: float | None) -> float:
        return (time.perf_counter() if now is None else now) - self.started
