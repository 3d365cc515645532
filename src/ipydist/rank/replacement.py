"""A process spawned to replace ranks that died (``--elastic``; see :mod:`ipydist.rank.heal`):
which ranks it replaces, and the world in which it has their number."""

from __future__ import annotations

#: The option a replacement is spawned with: the ranks it replaces, in the order of its
#: spawned job (the i-th process spawned takes the i-th number).
REPLACES_OPTION = "--ipydist-replaces="


def take_replaced_ranks(argv: list[str]) -> list[int] | None:
    """The ranks this process replaces (removing the option from ``argv``, which ipyparallel
    parses next), or None for a rank mpiexec started."""
    for i, arg in enumerate(argv):
        if arg.startswith(REPLACES_OPTION):
            del argv[i]
            return [int(r) for r in arg[len(REPLACES_OPTION):].split(",") if r]
    return None


def world(mpi, replaces: list[int]):
    """In a spawned replacement: the healed world, in which it has the number it replaces."""
    parent = mpi.Comm.Get_parent()
    merged = parent.Merge(high=True)
    world = merged.Split(0, key=replaces[mpi.COMM_WORLD.Get_rank()])
    merged.Free()
    return world
