"""Broadcasting Python objects, parameters and optimizer state, as Horovod's functions do.

Parameters travel flattened, one buffer per dtype and device, so a model with hundreds of
small tensors costs a handful of broadcasts rather than hundreds.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ipydist.torch._core import resync, waiting
from ipydist.torch._core.marks import waits_for_peers
from ipydist.torch._wire import call_check, signature, starts, transport
from ipydist.torch._wire.starts import check_root
from ipydist.torch.horovod.basics import rank, size
from ipydist.torch.horovod.process_sets import ProcessSet, comms_for, global_process_set


@waits_for_peers("broadcast_object_list")
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (of ``process_set``; any picklable
    object)."""
    group = comms_for(process_set)
    check_root(root_rank, group)
    call_check.check("broadcast_object", root=root_rank, group=group)
    box = [obj if rank() == root_rank else None]
    # pickled bytes travel on the CPU (over a group that serves it): no copy to a GPU and
    # back, and no device sync
    dist.broadcast_object_list(box, src=root_rank, group=starts.torch_group_of(group))
    return box[0]


@waits_for_peers("all_gather_object")
def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj`` (of ``process_set``'s ranks), as a list in rank order."""
    group = comms_for(process_set)
    call_check.check("allgather_object", group=group)
    out: list[Any] = [None] * (size() if group is None else group.size)
    dist.all_gather_object(out, obj, group=starts.torch_group_of(group))
    return out


def _named_tensors(params) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable):
        items = []
        for i, p in enumerate(params):
            items.append(p if isinstance(p, tuple) else (str(i), p))
    else:
        raise TypeError(
            "broadcast_parameters takes a state_dict or a list of (name, tensor) pairs, "
            f"not {type(params).__name__}"
        )
    bad = [n for n, t in items if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"broadcast_parameters: not tensors: {', '.join(bad[:5])}")
    return items


@torch.no_grad()
@waits_for_peers("broadcast")  # inside no_grad: its wrapper's code is shared by every user
def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Overwrite parameters on every rank with ``root_rank``'s, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()``, or a list of pairs.
    One check covers the whole call: the ranks agree on every group's dtype and size first,
    so a rank with a different model raises before any of its broadcasts starts.
    """
    check_root(root_rank)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, t in _named_tensors(params):
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        groups.setdefault((t.dtype, t.device), []).append(t)
    first = next(iter(groups), (None, None))
    call_check.check(
        "broadcast_parameters", dtype=first[0], device=first[1],
        shape=[sum(t.numel() for t in tensors) for tensors in groups.values()], root=root_rank,
        extra=signature.plan_hash([f"{dtype}@{device.type}" for dtype, device in groups]),
    )
    for tensors in groups.values():
        resync.track_tensors(tensors)  # kept in step after an interrupt, too
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if transport.uses_mpi(flat):
            transport.broadcast_(flat, root_rank)
        else:
            on_device = flat.device.type != "cpu"
            waiting.wait_for(dist.broadcast(flat, src=root_rank, async_op=True,
                                            group=starts.torch_group_of(None, flat)),
                             on_device)
            if on_device:  # an NCCL abort ends the kernel early, without an error: look
                waiting.device_settled()  # before writing
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (lr, momentum...).

    The state travels as one pickled object with its tensors on the CPU; ``load_state_dict``
    moves them to each rank's parameter devices. An optimizer that has not stepped yet has
    no state: as in Horovod, each rank first takes one local step with zero gradients to
    create it (momentum buffers, Adam's moments), leaving zero ``grad`` on the parameters that
    require one; here the parameters are put back as they were, so that only the state comes
    from that step.
    """
    if not optimizer.state:
        _initialise_state(optimizer)
    state = None
    if rank() == root_rank:
        state = _to_cpu(optimizer.state_dict())
    state = broadcast_object(state, root_rank)
    optimizer.load_state_dict(state)


@torch.no_grad()
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """One local step on zero gradients (the wrapped optimizer's own step: no averaging),
    the parameters restored afterwards."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    kept = [p.detach().clone() for p in params]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    own: type[torch.optim.Optimizer] = next(
        cls for cls in type(optimizer).__mro__
        if "step" in vars(cls) and not hasattr(cls, "wrapper_name"))
    closure = inspect.signature(own.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return  # a step that needs the loss (LBFGS): its state is made by its first step
    own.step(optimizer)
    for p, value in zip(params, kept):
        p.copy_(value)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value
