"""A process spawned to replace ranks that died or to grow the world (``--elastic``; see
:mod:`ipydist.rank.healing.heal`): which rank it takes, how it is spawned (:func:`spawn_one`,
on both sides), and the world in which it has its number."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ipydist import protocol

#: The option a replacement is spawned with: the rank it takes.
REPLACES_OPTION = "--ipydist-replaces="
#: The option that names the ranks spawned after this one, in order: a new rank takes part in
#: their spawns (:func:`spawn_one`).
LATER_OPTION = "--ipydist-spawned-after="
#: The option that carries the environment mpiexec gave the ranks (base64 of JSON): on another
#: host a spawned process gets none of it, and MPI's info values are too short to hold it.
ENV_OPTION = "--ipydist-env="


def env_option(names) -> str:
    """:data:`ENV_OPTION` with this process's values of ``names``."""
    import base64
    import json
    import os

    given = {name: os.environ[name] for name in names if name in os.environ}
    return ENV_OPTION + base64.b64encode(json.dumps(given).encode()).decode()


def take_environment(argv: list[str]) -> None:
    """Set the variables :func:`env_option` carried (removing it from ``argv``)."""
    import base64
    import json
    import os

    value = _take_option(argv, ENV_OPTION)
    if value is not None:
        os.environ.update(json.loads(base64.b64decode(value)))


def _take_option(argv: list[str], prefix: str) -> str | None:
    """The value of the option ``prefix...`` in ``argv``, removed from it (ipyparallel
    parses the rest); None when it is not there."""
    for i, arg in enumerate(argv):
        if arg.startswith(prefix):
            del argv[i]
            return arg[len(prefix):]
    return None


def take_replaced_ranks(argv: list[str]) -> list[int] | None:
    """The ranks this process replaces (removing the option from ``argv``), or None for a
    rank mpiexec started."""
    value = _take_option(argv, REPLACES_OPTION)
    return None if value is None else [int(r) for r in value.split(",") if r]


def take_later_ranks(argv: list[str]) -> list[int]:
    """The ranks spawned after this one (removing the option from ``argv``)."""
    value = _take_option(argv, LATER_OPTION)
    return [int(r) for r in (value or "").split(",") if r]


def spawn_one(comm, number: int, later: list[int], host: str | None = None, env=()):
    """``comm`` and one new process, which takes rank ``number``, merged, ``comm``'s processes
    first (collective over ``comm``; MPI reads what to spawn at its root, rank 0, a rank that
    was there before). ``later``: the ranks to be spawned after this one, in whose spawns the
    new process takes part (:func:`world`); ``host``: where it goes.

    One process per spawn, each a job of its own: Open MPI ends a spawned job whole when one of
    its processes dies, so two ranks spawned together (``%dist_scale`` up by two, two dead
    ranks healed at once) died together, and the heal that followed failed (issue 46)."""
    from mpi4py import MPI

    args = ["-m", protocol.RANK_MODULE, f"{REPLACES_OPTION}{number}",
            LATER_OPTION + ",".join(map(str, later)), env_option(env), *sys.argv[1:]]
    info = MPI.Info.Create()
    info.Set("map_by", "slot:OVERSUBSCRIBE")  # mpiexec counts a dead rank's slot as taken
    if host:
        info.Set("host", host)
    try:
        inter = comm.Spawn(sys.executable, args=args, maxprocs=1, root=0, info=info)
    finally:
        info.Free()
    merged = inter.Merge(high=False)
    inter.Free()
    return merged


def spawned_into(comm, numbers: Sequence[int], my_rank: int,
                 hosts: dict[int, str] | None = None, env=()):
    """``comm``'s processes and one new process for each of ``numbers``, which it takes as
    its rank: the world ordered by rank, in which this process is ``my_rank`` (collective
    over ``comm``: the ranks that were there and the new ones spawned before, on both sides
    alike). One spawn per new rank (:func:`spawn_one`); ``hosts``: where each goes, by
    number. The variables named in ``env`` (what mpiexec gave the ranks: on another host a
    spawned process gets none of them) are set in theirs as in this rank's
    (:func:`env_option`). ``comm`` itself is left to the caller."""
    grown = comm
    for i, number in enumerate(numbers):
        bigger = spawn_one(grown, number, list(numbers[i + 1:]), (hosts or {}).get(number), env)
        if grown is not comm:
            grown.Free()
        grown = bigger
    world = grown.Split(0, key=my_rank)
    if grown is not comm:
        grown.Free()
    return world


def world(mpi, replaces: list[int], later: Sequence[int] = ()):
    """In a spawned rank: the world, in which it has the number it takes, once it has taken
    part in the spawns of the ranks ``later`` than it."""
    merged = mpi.Comm.Get_parent().Merge(high=True)
    world = spawned_into(merged, later, replaces[mpi.COMM_WORLD.Get_rank()])
    merged.Free()
    return world
