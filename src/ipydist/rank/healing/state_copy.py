"""A new rank gets rank 0's state: its process (:mod:`~ipydist.rank.healing.process_state`),
its variables (:mod:`~ipydist.rank.healing.state_pickle`) and its random states.

After a heal (:mod:`ipydist.rank.healing.heal`) or a grow a new rank has an empty namespace.
Rank 0 (the lowest survivor, ``root``) first sends what its process is (``sys.path``, the
working directory, the user's modules, ...); the new rank takes it and says which of the
user's modules it could not import, which then travel by value. Then rank 0's variables, as one
pickle, over MPI: a variable that does not pickle, or does not load on the new rank, is left
out by name and the rest are sent again, so one variable never costs the others. The new rank
holds a stand-in under each name left out (:mod:`~ipydist.rank.healing.stand_ins`), which says
so when used, never a ``NameError`` where the other ranks have the variable. Objects that know
their rank are rebound to the new rank's: ``hvd.shard()``'s samplers and torch's
``DistributedSampler`` made with the defaults (rank 0's copy would otherwise read rank 0's
part of the data); DDP models follow the new process group
(:mod:`ipydist.torch._core.group_holders`).
"""

from __future__ import annotations

import random
import sys
import types
from dataclasses import replace

from ipydist.protocol import HealReport

#: Names an IPython namespace holds that are the shell's, not the user's.
_SHELL_NAMES = {"In", "Out", "exit", "quit", "get_ipython"}


def user_variables(shell) -> dict:
    """The user's variables in ``shell``'s namespace (not the shell's own, not ``_``-names)."""
    hidden = getattr(shell, "user_ns_hidden", {})
    return {name: value for name, value in shell.user_ns.items()
            if not name.startswith("_") and name not in _SHELL_NAMES and name not in hidden}


def follow_new_group() -> tuple[list[str], list[str]]:
    """The default group was made again (a heal, a resize, a recovery's rebuild): DDP models
    follow it, what cannot is marked (:mod:`ipydist.torch._core.group_holders`); their names
    in the user's namespace."""
    from IPython import get_ipython

    from ipydist.torch._core import group_holders

    return group_holders.follow(user_variables(get_ipython()))


def random_states() -> dict:
    """Python's, numpy's and torch's random states (the CPU's, and this rank's GPU's)."""
    import numpy as np
    import torch

    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_random_states(states: dict) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def rebind(variables: dict, rank: int, size: int, was_rank: int, was_size: int) -> list[str]:
    """Point samplers made for rank ``was_rank`` of ``was_size`` (with the defaults) at rank
    ``rank`` of ``size``, and have DistributedOptimizers average over ``size`` ranks; the
    names of the samplers changed."""
    import math

    from torch.utils.data import DataLoader, DistributedSampler

    from ipydist.torch._core.learner_hooks import FollowsResize
    from ipydist.torch.training.data import ShardSampler
    from ipydist.torch.training.optimizer import is_distributed

    changed = []
    for name, value in variables.items():
        if is_distributed(value) and isinstance(value, FollowsResize) and was_size != size:
            value._ipydist_resized()
        sampler = value.sampler if isinstance(value, DataLoader) else value
        if not isinstance(sampler, (ShardSampler, DistributedSampler)) or (
                sampler.rank, sampler.num_replicas) != (was_rank, was_size) or (
                rank, size) == (was_rank, was_size):
            continue
        if isinstance(sampler, ShardSampler):
            sampler.set_place(rank, size)
        else:  # torch's sampler: its own arithmetic, as its __init__ does it
            sampler.rank, sampler.num_replicas = rank, size
            length = len(sampler.dataset)
            sampler.num_samples = math.ceil(
                ((length - size) if sampler.drop_last and length % size else length) / size)
            sampler.total_size = sampler.num_samples * size
        changed.append(name)
    return changed


def _in_namespace(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """``fn`` with ``namespace`` as its globals. cloudpickle gives a function defined in a cell
    a dict of its own with copies of the names it uses; on rank 0 it reads the namespace, so a
    name a later cell binds again would read differently on the replacement."""
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    new.__dict__.update(fn.__dict__)
    new.__annotations__ = fn.__annotations__
    new.__module__ = fn.__module__
    return new


def into_namespace(variables: dict, namespace: dict) -> None:
    """Put ``variables`` into ``namespace``, functions and classes of cells reading it."""
    def of_cells(value) -> bool:
        return getattr(value, "__module__", None) == "__main__"

    for name, value in variables.items():
        if isinstance(value, types.FunctionType) and of_cells(value):
            value = _in_namespace(value, namespace)
        elif isinstance(value, type) and of_cells(value):
            for attr, member in list(vars(value).items()):
                if isinstance(member, types.FunctionType):
                    setattr(value, attr, _in_namespace(member, namespace))
        namespace[name] = value


#: Message tags of the copy.
_PROCESS, _MODULES, _VARIABLES, _LOADED = 75, 76, 71, 77
#: How many times rank 0 sends its variables again, each time without the ones that did not
#: load, before the copy is given up.
TRIES = 8


def copy_from(root: int, to: list[int], was_size: int | None = None) -> HealReport:
    """Collective over the world: ``root`` sends its process state, variables and random
    states to the ranks ``to``, which take them (their samplers rebound from ``root``'s place
    in a world of ``was_size`` to theirs). Returns, on ``root``, the names not copied, and on
    a rank of ``to`` that could not load them, why."""
    from IPython import get_ipython

    from ipydist.torch._core import topology
    from ipydist.torch.horovod import process_sets

    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    out = HealReport()
    if rt.rank == root:
        out = _send(rt, get_ipython(), to)
    elif rt.rank in to:
        out = _take(rt, get_ipython(), root, was_size or rt.size)
    rt.control_comm.Barrier()
    if process_sets.any_added():  # the same answer on every rank now
        out = replace(out, sets_removed=tuple(process_sets.rejoin(rt.size)))
    return out


def _send(rt, shell, to: list[int]) -> HealReport:
    """On ``root``: its process state, then its variables until every rank of ``to`` loaded
    them (each try without the variables that did not load)."""
    from ipydist.rank.healing import process_state, state_pickle, state_transfer
    from ipydist.torch._core import group_holders
    from ipydist.torch.horovod import process_sets

    comm = rt.control_comm
    process = process_state.gather(shell)
    for rank in to:
        comm.send(process, dest=rank, tag=_PROCESS)
    unreachable: dict[str, str] = {}
    for rank in to:
        unreachable.update(comm.recv(source=rank, tag=_MODULES))
    variables = user_variables(shell)
    skipped = {name: why for name, value in variables.items()
               if (why := group_holders.not_copied(value))}
    pending, sent, on_gpu = list(to), 0, 0
    with process_state.by_value(unreachable):
        for attempt in range(TRIES):
            storages: list = []
            on_device: list | None = [] if state_transfer.gpu_to_gpu(rt) else None
            payload, unpicklable = state_pickle.pack(
                {n: v for n, v in variables.items() if n not in skipped}, storages, on_device)
            skipped.update(unpicklable)
            views = [memoryview(s).cast("B") for s in storages]
            sizes = [v.nbytes for v in views]
            device_sizes = [s.nbytes() for s in on_device or []]
            sent = len(payload) + sum(sizes) + sum(device_sizes)
            on_gpu = sum(device_sizes)
            for rank in pending:
                comm.send((payload, sizes, device_sizes, random_states(),
                           process_sets.registry(), skipped), dest=rank, tag=_VARIABLES)
            state_transfer.send(comm, views, pending, on_device or [])
            failures = {rank: comm.recv(source=rank, tag=_LOADED) for rank in pending}
            pending = [rank for rank, failure in failures.items() if failure is not None]
            blamed = dict(failure for failure in failures.values() if failure is not None)
            if not pending:
                break
            if None in blamed or attempt == TRIES - 1:  # not one variable's fault: given up
                for rank in pending:
                    comm.send(None, dest=rank, tag=_VARIABLES)
                break
            skipped.update(blamed)
    return HealReport(bytes=sent, on_device=on_gpu,
                      skipped=tuple(f"{name} ({why})" for name, why in skipped.items()),
                      by_value=tuple(sorted(unreachable)))


def _take(rt, shell, root: int, was_size: int) -> HealReport:
    """On a new rank: ``root``'s process state, then its variables, saying each time whether
    they loaded (and if not, which one did not)."""
    from ipydist.rank.healing import process_state, state_pickle, state_transfer
    from ipydist.torch.horovod import process_sets

    comm = rt.control_comm
    unreachable = process_state.apply(comm.recv(source=root, tag=_PROCESS), shell)
    comm.send(unreachable, dest=root, tag=_MODULES)
    last = f"rank {root} gave up sending its variables"
    first = True
    while (message := comm.recv(source=root, tag=_VARIABLES)) is not None:
        payload, sizes, device_sizes, states, known_sets, skipped = message
        received, on_device = state_transfer.receive(comm, root, sizes, device_sizes)
        if first:  # before loading: a variable may name a set
            process_sets.adopt(known_sets)
            first = False
        try:
            variables = state_pickle.load(payload, received, on_device)
        except state_pickle.NotLoaded as e:
            last = f"{e.name or 'the variables'}: {e.why}"
            comm.send((e.name, e.why), dest=root, tag=_LOADED)
            continue
        comm.send(None, dest=root, tag=_LOADED)
        try:
            rebound = rebind(variables, rt.rank, rt.size, root, was_size)
            into_namespace(variables, shell.user_ns)
            _stand_in_for(skipped, shell.user_ns)
            _follow(variables, unreachable)
            set_random_states(states)
        except Exception as e:  # said to the notebook after the others are let go
            return HealReport(failed=f"{type(e).__name__}: {e}")
        return HealReport(rebound=tuple(rebound))
    return HealReport(failed=f"loading rank {root}'s variables failed ({last})")


def _stand_in_for(skipped: dict[str, str], namespace: dict) -> None:
    """A stand-in under each name not copied, which says so when used (never a NameError
    where the other ranks have the variable)."""
    from ipydist.rank.healing.stand_ins import NotCopied

    for name, why in skipped.items():
        namespace[name] = NotCopied(name, why)


def _follow(variables: dict, by_value: dict[str, str]) -> None:
    """What the loaded variables need here: DDP models tracked and their hooks registered,
    and each module that came by value importable by its name, as on rank 0."""
    from torch.nn.parallel import DistributedDataParallel

    from ipydist.torch._core import group_holders

    for value in variables.values():
        if isinstance(value, DistributedDataParallel):
            group_holders.adopt(value)
        elif isinstance(value, types.ModuleType) and value.__name__ in by_value:
            sys.modules.setdefault(value.__name__, value)


def resized(was_size: int) -> HealReport:
    """On a rank that stayed through ``Session.scale``: its samplers and DistributedOptimizers
    follow the world's new size; shrinking, its process sets are made in the new world (those
    naming a rank that left are removed). Says which samplers and which sets."""
    from IPython import get_ipython

    from ipydist.torch._core import topology
    from ipydist.torch.horovod import process_sets

    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    rebound = rebind(user_variables(get_ipython()), rt.rank, rt.size, rt.rank, was_size)
    removed: list[str] = []
    if rt.size < was_size and process_sets.any_added():  # growing, copy_from did it
        removed = process_sets.rejoin(rt.size)
    return HealReport(rebound=tuple(rebound), sets_removed=tuple(removed))


def renumbered(was_rank: int, was_size: int, gone: list[int]) -> HealReport:
    """On a survivor of a world that went on without ``gone`` (renumbered from 0): its
    samplers and DistributedOptimizers follow its new rank and the new size, and its process
    sets are made again (renumbered; those naming a rank that is gone removed). Collective.
    Says which samplers and which sets."""
    from IPython import get_ipython

    from ipydist.torch._core import topology
    from ipydist.torch.horovod import process_sets

    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    rebound = rebind(user_variables(get_ipython()), rt.rank, rt.size, was_rank, was_size)
    removed = process_sets.rejoin(rt.size, gone=gone) if process_sets.any_added() else []
    return HealReport(rebound=tuple(rebound), sets_removed=tuple(removed))
