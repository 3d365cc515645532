"""What holds the default process group besides ipydist, and what becomes of it when the group
is made again (a heal, a resize, a recovery that rebuilt it).

A ``DistributedDataParallel`` model keeps the group it was made with, and its next backward
would wait on connections to ranks that are gone. One made over the default group follows
the new one with no code from the user: its reducer is reset onto the new group
(``DistributedDataParallel._update_process_group``, PyTorch's own way to shrink or grow a DDP
model's world) and its communication hooks' states that named the old group name the new one,
as a :class:`~ipydist.torch.training.optimizer.DistributedOptimizer` is wrapped again. What
cannot follow safely (a DDP model over a group of its own or a device mesh, an FSDP2 module
sharded over a mesh, a ``DeviceMesh``) is marked: its next use raises
:class:`GroupGone`, naming the variable and saying to make it again, instead of gloo's
"Connection closed by peer" from deep inside torch.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from ipydist.error_base import IpydistError
from ipydist.torch._core import shims


class GroupGone(IpydistError, RuntimeError):
    """A model or mesh made over the process group of before a heal or a recovery was used."""


def adopt(ddp) -> None:
    """A DDP model a replacement rank loaded from rank 0's pickle (its reducer was made over
    this rank's default group as it loaded): tracked as if made here, with its communication
    hooks registered again (the pickle keeps their list, not their registration)."""
    shims.track(ddp, True)
    for hook, state in getattr(ddp, "_comm_hooks", []):
        dist._register_comm_hook(ddp.reducer, state, hook)


def follow(variables: dict) -> tuple[list[str], list[str]]:
    """After the default group was made again: every DDP model over the old default group
    follows the new one; what cannot is marked (see the module's docstring). Returns (the
    names in ``variables`` of the models that followed, the names and kinds of what was
    marked), for the notebook's line."""
    new = dist.group.WORLD if dist.is_initialized() else None
    followed, marked = [], []
    names = _names_of(variables)
    for ddp, on_default in shims.ddp_models():
        name = names.get(id(ddp))
        if on_default and new is not None:
            if ddp.process_group is not new:
                _remake_reducer(ddp)
            if name:
                followed.append(name)
        elif name and _mark(ddp, name, "a DistributedDataParallel model over a group of its own",
                            f"wrap {name}.module again"):
            marked.append(f"{name} (wrap it again)")
    for name, value in variables.items():
        if _is_fsdp2(value) and _mark(value, name, "an FSDP2 module",
                                      f"fully_shard the model again and assign it to {name}"):
            marked.append(f"{name} (fully_shard it again)")
        elif _is_mesh(value) and _mark(value, name, "a DeviceMesh",
                                       "make it again with init_device_mesh"):
            marked.append(f"{name} (init_device_mesh again)")
    return sorted(followed), marked


def _remake_reducer(ddp) -> None:
    """``ddp``'s reducer made again over the new default group, as unpickling a DDP model
    makes it (so that a replacement's, which is unpickled, has the same buckets: a reducer
    that only changed group keeps the buckets it rebuilt, and the ranks' allreduces would
    pair up different parameters), its hooks registered again, its buckets to be rebuilt
    together after the next step."""
    from torch.nn.parallel import DistributedDataParallel

    old = ddp.process_group
    state = {key: value for key, value in ddp.__dict__.items()
             if key not in ("process_group", "reducer", "logger")}
    state["broadcast_buffers"] = ddp.forward_sync_buffers
    state["_has_rebuilt_buckets"] = False
    del ddp.reducer  # its autograd hooks go with it
    DistributedDataParallel.__setstate__(ddp, state)
    for hook, hook_state in getattr(ddp, "_comm_hooks", []):
        _rename_group(hook_state, old)
        dist._register_comm_hook(ddp.reducer, hook_state, hook)


def _names_of(variables: dict) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, value in sorted(variables.items()):
        names.setdefault(id(value), name)
    return names


def _rename_group(state, old) -> None:
    """A communication hook's state that names the old group (PowerSGD's, or a user's with a
    ``process_group``) names the new default group instead."""
    if getattr(state, "process_group", None) is old:
        try:
            state.process_group = dist.group.WORLD
        except AttributeError:
            pass


def _message(name: str, what: str, todo: str) -> str:
    return (f"{name} is {what} made over the process group of before the last heal or "
            f"recovery, which is gone: {todo} (its parameters are intact).")


def _mark(held, name: str, what: str, todo: str) -> bool:
    """The next use of ``held`` raises :class:`GroupGone`: a module's next forward, a mesh's
    next ask for its groups. False if it was marked already."""
    if getattr(held, "_ipydist_group_gone", False):
        return False
    message = _message(name, what, todo)

    def refuse(*_args, **_kwargs):
        raise GroupGone(message)

    if _is_mesh(held):
        held.get_group = held.get_all_groups = refuse
    else:
        held.register_forward_pre_hook(refuse, prepend=True)
    held._ipydist_group_gone = True
    return True


def _is_fsdp2(value) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(value, getattr(fsdp, "FSDPModule", ()))


def _is_mesh(value) -> bool:
    mesh = sys.modules.get("torch.distributed.device_mesh")
    return mesh is not None and isinstance(value, getattr(mesh, "DeviceMesh", ()))


def not_copied(value) -> str | None:
    """Why a heal does not copy ``value`` to a replacement, for what holds its ranks' shards
    or groups (None: it is copied): the replacement gets a stand-in that says so."""
    if _is_fsdp2(value):
        return "an FSDP2 module, whose shards live on their ranks; fully_shard it again"
    if _is_mesh(value):
        return "a DeviceMesh over the ranks of before; make it again with init_device_mesh"
    return None
