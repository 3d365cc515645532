"""A replacement rank gets rank 0's state: its variables, in one pickle, and its random states.

After a heal (:mod:`ipydist.rank.healing.heal`) a replacement has an empty namespace. Rank 0 (the
lowest survivor, ``root``) pickles every variable of its namespace that pickles with
cloudpickle (functions and classes defined in cells travel by value, modules by name) as one
object, so that what its variables share stays shared (an optimizer's parameters are the
model's), and sends it over MPI to each replacement, which loads it into its own namespace.
The tensors' storages are left out of that pickle, each once, and travel as bytes from the
tensors' own memory (:mod:`ipydist.rank.healing.state_transfer`).
Variables that do not pickle (a generator, an open file, a live iterator over a DataLoader)
are named in the notebook's message. Objects that know their rank are rebound to the
replacement's: ``hvd.shard()``'s samplers and torch's ``DistributedSampler`` made with the
defaults (rank 0's copy would otherwise read rank 0's part of the data).
"""

from __future__ import annotations

import contextlib
import random
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


def pack(variables: dict, storages: list | None = None,
         on_device: list | None = None) -> tuple[bytes, list[str]]:
    """(one pickle of every variable that pickles, the names of those that do not, with
    their types). Tries all at once first; only when that fails, one by one. ``storages``:
    a list that gets the tensors' bytes, each a buffer over the tensor's own memory, which
    the pickle then leaves out (``pickle.loads(..., buffers=)`` takes them back); None: the
    pickle holds them. ``on_device``: a list that gets the GPU's storages themselves, to
    travel from GPU to GPU (:func:`loading_device_storages` gives them back); None: a GPU's
    storage travels through host memory as the others do."""
    try:
        return _dumps(variables, storages, on_device), []
    except Exception:
        for found in (storages, on_device):
            if found:
                found.clear()
    kept, skipped = {}, []
    for name, value in variables.items():
        try:
            _dumps(value, [], None if on_device is None else [])
        except Exception:
            skipped.append(f"{name} ({type(value).__name__})")
        else:
            kept[name] = value
    return _dumps(kept, storages, on_device), skipped


#: While a replacement loads its variables: the GPU storages that came from GPU to GPU, by
#: their index in the pickle's (see :func:`pack`).
_device_storages: list = []


@contextlib.contextmanager
def loading_device_storages(storages: list):
    """Give the pickle being loaded ``storages``, the GPU storages that travelled beside it."""
    _device_storages[:] = storages
    try:
        yield
    finally:
        _device_storages.clear()


def _device_storage(index: int):
    return _device_storages[index]


def _dumps(value, storages: list | None = None, on_device: list | None = None) -> bytes:
    import io

    import cloudpickle
    import torch

    class StatePickler(cloudpickle.Pickler):
        """cloudpickle, with each tensor storage pickled once, however many tensors view it
        (torch pickles a storage anew for every tensor: a view and its base came back as two
        copies), and a GPU's storage pickled from host memory, to be loaded onto the
        receiving rank's own GPU (torch would load it onto the sender's)."""

        def __init__(self, file, buffer_callback=None) -> None:
            super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL,
                             buffer_callback=buffer_callback)
            self.storages: dict[int, _Storage] = {}

        def reducer_override(self, obj):
            if isinstance(obj, torch.storage.TypedStorage):
                untyped = obj._untyped_storage
                one = self.storages.setdefault(untyped._cdata, _Storage(untyped, on_device))
                return _typed_storage, (one, obj.dtype)
            return super().reducer_override(obj)

    file = io.BytesIO()
    StatePickler(file, None if storages is None else storages.append).dump(value)
    return file.getvalue()


class _Storage:
    """One tensor storage in a state's pickle (see :func:`_dumps`): the same object for every
    tensor that views it, so that the pickle holds it once and its tensors share it again."""

    def __init__(self, untyped, on_device: list | None = None) -> None:
        self.untyped, self.on_device = untyped, on_device

    def __reduce__(self):
        import pickle

        import torch

        on_gpu = self.untyped.device.type == "cuda"
        if on_gpu and self.on_device is not None:  # it travels from GPU to GPU, beside
            self.on_device.append(self.untyped)
            return _device_storage, (len(self.on_device) - 1,)
        host = self.untyped.cpu() if on_gpu else self.untyped
        data = torch.empty(0, dtype=torch.uint8).set_(host).numpy()  # its bytes, not a copy
        return _untyped_storage, (pickle.PickleBuffer(data), on_gpu)


def _untyped_storage(data, on_gpu: bool):
    """A storage loaded on the receiving rank, over the bytes the pickle gave (a bytearray,
    or the array :func:`copy_from` received them into: no copy); a GPU's onto this rank's
    own GPU."""
    import torch

    if len(data):
        untyped = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    else:
        untyped = torch.empty(0, dtype=torch.uint8).untyped_storage()
    if on_gpu and torch.cuda.is_available():
        return untyped.cuda(torch.cuda.current_device())
    return untyped


def _typed_storage(untyped, dtype):
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


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

    from ipydist.torch.training.data import ShardSampler
    from ipydist.torch.training.optimizer import is_distributed

    changed = []
    for name, value in variables.items():
        if is_distributed(value) and was_size != size:
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


def copy_from(root: int, to: list[int], was_size: int | None = None) -> HealReport:
    """Collective over the world: ``root`` sends its variables and random states to the
    ranks ``to``, which load them (their samplers rebound from ``root``'s place in a world
    of ``was_size`` to theirs). Returns, on ``root``, the names not copied."""
    from IPython import get_ipython

    from ipydist.rank.healing import state_transfer
    from ipydist.torch._core import topology
    from ipydist.torch.horovod import process_sets

    rt = topology.get()
    assert rt is not None  # a rank's, made at its start
    comm = rt.control_comm
    shell = get_ipython()
    out = HealReport()
    if rt.rank == root:
        storages: list = []
        on_device: list | None = [] if state_transfer.gpu_to_gpu(rt) else None
        payload, skipped = pack(user_variables(shell), storages, on_device)
        views = [memoryview(s).cast("B") for s in storages]
        sizes = [v.nbytes for v in views]
        device_sizes = [s.nbytes() for s in on_device or []]
        out = replace(out, bytes=len(payload) + sum(sizes) + sum(device_sizes),
                      skipped=tuple(skipped), on_device=sum(device_sizes))
        for rank in to:
            comm.send((payload, sizes, device_sizes, random_states(),
                       process_sets.registry()), dest=rank, tag=71)
        state_transfer.send(comm, views, to, on_device or [])
    elif rt.rank in to:
        import cloudpickle

        payload, sizes, device_sizes, states, known_sets = comm.recv(source=root, tag=71)
        received, on_device = state_transfer.receive(comm, root, sizes, device_sizes)
        process_sets.adopt(known_sets)  # before loading: a variable may name a set
        try:
            with loading_device_storages(on_device):
                variables = cloudpickle.loads(payload, buffers=received)
            out = replace(out, rebound=tuple(rebind(variables, rt.rank, rt.size, root,
                                                    was_size or rt.size)))
            into_namespace(variables, shell.user_ns)
            set_random_states(states)
        except Exception as e:  # said to the notebook after the others are let go
            out = replace(out, failed=f"{type(e).__name__}: {e}")
    comm.Barrier()
    if process_sets.any_added():  # the same answer on every rank now
        out = replace(out, sets_removed=tuple(process_sets.rejoin(rt.size)))
    return out


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
