"""One cluster's launch plan (:class:`Plan`): the command that starts the ranks, its arguments
and environment, the launcher chosen for it, and what the start table and the failure reports
say of it. Made before any process starts, by :func:`ipydist.notebook.launch.mpiexec.plan` or
:func:`ipydist.notebook.launch.slurm.plan`; carried out by
:class:`~ipydist.notebook.cluster.Cluster`. A module of its own so that each launcher's planning
and the cluster import it, and none of them each other's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ipydist.network import Route
from ipydist.notebook.launch import launchers
from ipydist.notebook.launch.hosts import Hosts


@dataclass
class Plan:
    """The mpiexec arguments and environment for one cluster, plus notes for the user."""

    mpiexec: str
    flavor: str
    args: list[str]
    env: dict[str, str]
    multi_host: bool
    notes: list[str] = field(default_factory=list)
    #: Across hosts: this host's way to them (the controller listens there); None on one host.
    route: Route | None = None
    #: The hosts, when named (``--hosts``, ``--hostfile``, Slurm): for the start table.
    hosts: Hosts | None = None
    #: What ipyparallel runs before ``-n N ARGS program``: mpiexec, or Slurm's ``srun`` (or
    #: ``salloc ... srun``: :mod:`ipydist.notebook.launch.slurm`).
    command: list[str] = field(default_factory=list)
    #: The launcher, chosen once by the plan: what differs between launchers is asked of it.
    launcher: launchers.Launcher = field(default_factory=launchers.UnknownMPI)
    #: What to check when the launch fails, after the launcher's own words.
    hint: str = "Check the MPI installation (mpiexec --version), --mpi and --mpi-args."
    #: Whether the cluster made a Slurm allocation of its own, to give back when it stops.
    allocates: bool = False
    #: Whether the ranks outlive one that dies (MPI's fault tolerance: ``--elastic``).
    elastic: bool = False
    #: How many ranks it starts.
    np: int = 0
    #: How many hot spares it starts beside them (``--spares``).
    spares: int = 0
    #: Whether a heal or a grow may start a new process once the spares are used up (an MPI
    #: spawn, which needs MPI's TCP transport: see :func:`healing_choice`).
    can_spawn: bool = False

    def __post_init__(self):
        self.command = self.command or [self.mpiexec]

    @property
    def title(self) -> str:
        """How the start line names the launch (``Open MPI``, ``Slurm (srun in job 12)``)."""
        return self.launcher.title

    @property
    def command_name(self) -> str:
        """The name of the command that starts the ranks (``mpiexec``, ``mpiexec.gforker``,
        ``srun``, ``salloc``), past the ``env -u NAME ...`` in front of it where it has one."""
        return os.path.basename(program_of(self.command))


def program_of(command: list[str]) -> str:
    """The program ``command`` runs: its first word, or past ``env -u NAME ...`` where the
    command begins so (Slurm's, inside a job step)."""
    first = 0
    if os.path.basename(command[0]) == "env":
        first = 1
        while first < len(command) and command[first] == "-u":
            first += 2
    return command[first]
