"""Rank 0's variables as one pickle, for a heal's replacement or ``%dist_scale``'s new ranks.

One pickle of every variable at once, so that what they share stays shared (an optimizer's
parameters are the model's), made with cloudpickle (functions and classes defined in cells
travel by value, modules by name, or by value where the replacement cannot import them). The
tensors' storages are left out of it, each once, and travel as bytes from the tensors' own
memory (:mod:`ipydist.rank.healing.state_transfer`).

A variable that does not pickle on rank 0 (a generator, an open file) is left out, by name;
one that does not load on the replacement (a class whose module it cannot import) is found
by its mark in the pickle, said by name, and left out of the next try
(:mod:`ipydist.rank.healing.state_copy`): one variable never costs the others.
"""

from __future__ import annotations

import contextlib

from ipydist.error_base import IpydistError

#: How long a reason for a variable not copied may be, in characters.
WHY_CHARACTERS = 120


def pack(variables: dict, storages: list | None = None,
         on_device: list | None = None) -> tuple[bytes, dict[str, str]]:
    """(one pickle of every variable that pickles, each after its mark (:func:`load`), the
    names of those that do not, with why). Tries all at once first; only when that fails,
    one by one. ``storages``: a list that gets the tensors' bytes, each a buffer over the
    tensor's own memory, which the pickle then leaves out (:func:`load`'s ``buffers`` take
    them back); None: the pickle holds them. ``on_device``: a list that gets the GPU's
    storages themselves, to travel from GPU to GPU (:func:`loading_device_storages` gives
    them back); None: a GPU's storage travels through host memory as the others do."""
    try:
        return _dumps(_marked(variables), storages, on_device), {}
    except Exception:
        for found in (storages, on_device):
            if found:
                found.clear()
    kept, skipped = {}, {}
    for name, value in variables.items():
        try:
            _dumps(value, [], None if on_device is None else [])
        except Exception as e:
            skipped[name] = f"a {type(value).__name__}, which does not pickle: {short(e)}"
        else:
            kept[name] = value
    return _dumps(_marked(kept), storages, on_device), skipped


def short(error: BaseException) -> str:
    """An error as a clause of the heal's line: its message (with its type where the
    message alone does not say what it is), cut to WHY_CHARACTERS."""
    text = str(error) if isinstance(error, ImportError) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= WHY_CHARACTERS else text[:WHY_CHARACTERS - 3] + "..."


class _Mark:
    """Where a variable's value starts in the state's pickle: loading it says which variable
    is being loaded (:func:`load` then knows which one failed)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return _loading, (self.name,)


#: The variable being loaded now (see :class:`_Mark`).
_now: list = [None]


def _loading(name: str) -> str:
    _now[0] = name
    return name


def _marked(variables: dict) -> list:
    return [(_Mark(name), value) for name, value in variables.items()]


class NotLoaded(IpydistError):
    """A variable of rank 0's pickle did not load here: ``name`` (None: not one variable's
    fault), and why."""

    def __init__(self, name: str | None, why: str) -> None:
        super().__init__(why)
        self.name, self.why = name, why


def load(payload: bytes, buffers, on_device: list) -> dict:
    """The variables of :func:`pack`'s pickle, over the storages ``buffers`` (and the GPU
    storages ``on_device``); raises :class:`NotLoaded` naming the variable that failed."""
    import cloudpickle

    _now[0] = None
    try:
        with loading_device_storages(on_device):
            pairs = cloudpickle.loads(payload, buffers=buffers)
    except Exception as e:
        raise NotLoaded(_now[0], short(e)) from e
    finally:
        _now[0] = None
    return dict(pairs)


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
    from IPython import get_ipython

    shell = get_ipython()

    class StatePickler(cloudpickle.Pickler):
        """cloudpickle, with each tensor storage pickled once, however many tensors view it
        (torch pickles a storage anew for every tensor: a view and its base came back as two
        copies), a GPU's storage pickled from host memory, to be loaded onto the receiving
        rank's own GPU (torch would load it onto the sender's), and the shell (a cell's
        ``ip = get_ipython()``) as the receiving rank's own."""

        def __init__(self, file, buffer_callback=None) -> None:
            super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL,
                             buffer_callback=buffer_callback)
            self.storages: dict[int, _Storage] = {}

        def reducer_override(self, obj):
            if isinstance(obj, torch.storage.TypedStorage):
                untyped = obj._untyped_storage
                one = self.storages.setdefault(untyped._cdata, _Storage(untyped, on_device))
                return _typed_storage, (one, obj.dtype)
            if obj is shell and shell is not None:
                return get_ipython, ()
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


