"""Checkpoints that rank 0 writes atomically and every rank can load.

A checkpoint file is either the previous one or the complete new one, never half of either:
rank 0 writes to a temporary file next to it, syncs it to disk, and renames it over the old one.
Restore with::

    ckpt = hvd.load_checkpoint(path)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    start_epoch = ckpt["epoch"] + 1
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ipydist.torch._core.learner_hooks import KeepsRankState
from ipydist.torch._wire.starts import torch_group_of
from ipydist.torch.horovod.basics import device, rank, size
from ipydist.torch.horovod.functions import allgather_object, broadcast_object


def save_checkpoint(path: str | os.PathLike, /, **state: Any) -> None:
    """Write ``state`` to ``path`` from rank 0; return on every rank once the file is there.

    Values with a ``state_dict()`` (modules, optimizers, LR schedulers, grad scalers) are saved
    as their state dict, so ``save_checkpoint(p, model=model, optimizer=opt, epoch=3)`` stores
    ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}``. Tensors are
    saved on the device they are on. Every rank calls it (it is collective). When rank 0 cannot
    write, every rank raises ``RuntimeError`` with rank 0's reason, and a checkpoint that was
    already at ``path`` is left as it was.

    State that differs between ranks by design (1-bit SGD's residuals, block momentum's local
    models within a block) is gathered from every rank into the saved state dict, and each
    rank's ``load_state_dict`` takes its own back: resuming continues bit-identically.
    """
    path = os.fspath(path)
    error, cause = None, None
    per_rank = _rank_states(state)
    if rank() == 0:
        try:
            saved = {k: _saved_form(v) for k, v in state.items()}
            for k, states in per_rank.items():
                saved[k] = {**saved[k], RANK_STATE_KEY: states}
            _atomic_save(saved, path)
        except Exception as e:  # every rank must hear about it, so none waits forever
            error, cause = f"{type(e).__name__}: {e}", e
    error = broadcast_object(error, root_rank=0)  # also the barrier: the file is there now
    if error is not None:
        raise RuntimeError(
            f"rank 0 could not write checkpoint {path}: {error} "
            "(any earlier checkpoint there is unchanged)"
        ) from cause


def load_checkpoint(path: str | os.PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """The dict :func:`save_checkpoint` wrote, with its tensors on this rank's ``device()``
    (the ranks' own states, which each loader takes its entry of, on the CPU).

    Every rank reads the file itself. ``weights_only=True`` (the default) lets the file hold
    only tensors, numbers, strings and containers of them: unpickling anything else could run
    code from the file. Pass ``weights_only=False`` only for a file you trust.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        where = path if os.path.isabs(path) else f"{path} ({os.path.abspath(path)})"
        raise FileNotFoundError(
            f"no checkpoint file at {where}: check the path, or write one with save_checkpoint"
        )
    try:
        if not weights_only:  # objects of any kind: torch moves every storage
            return torch.load(path, map_location=device(), weights_only=False)
        # the ranks' own states stay on the CPU: each loader takes its own entry and puts it
        # where the tensor it replaces lives
        here = device()
        return _map_tensors(torch.load(path, map_location="cpu"), lambda t: t.to(here),
                            skip=RANK_STATE_KEY)
    except pickle.UnpicklingError as e:
        if not weights_only:
            raise
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise ValueError(
            f"checkpoint {path} holds Python objects{what} other than tensors, numbers, strings "
            "and containers of them, which weights_only=True refuses to unpickle because that "
            "could run code from the file. If you trust the file, load it with "
            "load_checkpoint(path, weights_only=False)."
        ) from e


#: Key, in a saved state dict, of the per-rank states ``save_checkpoint`` gathers (a list in
#: rank order): what differs between ranks by design, such as 1-bit SGD's residuals or block
#: momentum's local model, which rank 0's own state dict cannot stand for.
RANK_STATE_KEY = "ipydist_rank_state"


def this_ranks(per_rank: list | None, what: str) -> Any:
    """This rank's entry of a gathered per-rank state, or None (with a warning when the
    checkpoint was written by a different number of ranks: ``what`` then start afresh)."""
    if per_rank is None:
        return None
    if len(per_rank) != size():
        warnings.warn(
            f"the checkpoint was written by {len(per_rank)} ranks and this run has {size()}: "
            f"{what} start afresh", stacklevel=3)
        return None
    return per_rank[rank()]


def _rank_states(state: dict[str, Any]) -> dict[str, list]:
    """Every rank's own state of each value that has one (collective: every rank calls
    ``save_checkpoint``), gathered to rank 0, which writes; empty elsewhere, and when no value
    has one. The states travel as CPU tensors, to rank 0 alone: pickled CUDA tensors would be
    unpickled onto the receiver's GPU of the same index (a CUDA context on another rank's GPU,
    "invalid device ordinal" where hosts differ), and every rank would hold every rank's."""
    mine = {k: v._ipydist_rank_state() for k, v in state.items()
            if isinstance(v, KeepsRankState)}
    mine = {k: _map_tensors(v, lambda t: t.detach().cpu()) for k, v in mine.items()
            if v is not None}
    if not any(allgather_object(bool(mine))):
        return {}
    everyone: list | None = [None] * size() if rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0, group=torch_group_of(None))
    if everyone is None:
        return {}
    return {k: [states.get(k) for states in everyone] for k in set().union(*everyone)}


def _map_tensors(value: Any, fn, skip: str | None = None) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, through dicts, lists and tuples
    (the entry of a dict under the key ``skip`` left as it is)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: v if k == skip else _map_tensors(v, fn, skip) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn, skip) for v in value)
    return value


def _saved_form(value: Any) -> Any:
    state_dict = getattr(value, "state_dict", None)
    if callable(state_dict) and not isinstance(value, type):
        return state_dict()
    return value


def _atomic_save(state: dict[str, Any], path: str) -> None:
    """``torch.save(state)`` to ``path`` so that ``path`` never holds a partial file.

    The bytes go to a temporary file in the same directory (so the rename stays on one file
    system), are synced to disk, and the file is renamed over ``path``; then the directory is
    synced so the rename itself survives a crash. On any error the temporary file is removed.
    """
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = _create_temp(directory, name)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _create_temp(directory: str, name: str) -> tuple[int, str]:
    """A new file ``.NAME.XXXXXXXX.tmp`` in ``directory``, created with the umask's mode.

    ``tempfile`` would create it readable by its owner only, and the rename would keep that.
    """
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory; the rename is done regardless
        pass
    finally:
        os.close(fd)
