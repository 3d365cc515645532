"""A process spawned to replace ranks that died (``--elastic``; see :mod:`ipydist.rank.heal`):
which ranks it replaces, and the world in which it has their number."""

from __future__ import annotations

#: The option a replacement is spawned with: the ranks it replaces, in the order of its
#: spawned job (the i-th process spawned takes the i-th number).
REPLACES_OPTION = "--ipydist-replaces="
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


def world(mpi, replaces: list[int]):
    """In a spawned replacement: the healed world, in which it has the number it replaces."""
    parent = mpi.Comm.Get_parent()
    merged = parent.Merge(high=True)
    world = merged.Split(0, key=replaces[mpi.COMM_WORLD.Get_rank()])
    merged.Free()
    return world
