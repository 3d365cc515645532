"""PowerSGD (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019) as one bucket's exchange, kept from one step to the
next, as PyTorch's DDP ``powerSGD_hook`` keeps it.

A gradient of two or more dimensions, seen as an n x m matrix (its first dimension by the rest),
travels as two thin matrices of ``rank`` columns, n r + m r values instead of n m. A step on each
rank, for a bucket:

1. M = this rank's gradient plus its error feedback (what earlier steps did not send);
2. P = M Q, with Q the last step's (the warm start), or at the first step (and after anything
   that may have left the ranks' Qs apart) a random one drawn from a seed every rank shares;
   the Ps summed over the ranks, in one allreduce with what travels whole;
3. P orthonormalized; Q = M^T P; the Qs summed (a second allreduce);
4. the sum over the ranks is P Q^T, and this rank's error feedback becomes M - P Q^T / N.

Vectors (biases, norms' weights), matrices too small to gain (n m < ``min_compression_rate``
times (n + m) r) and the had-gradient flags travel whole, in full precision, in the first
allreduce. The bucket's values are prescaled (Average divides before the sum), so P Q^T
approximates the prescaled sum, as the full-precision path's allreduce computes it exactly.

What is kept: the error feedback (this rank's own: a checkpoint keeps it per rank) and Q (the
same on every rank). Both take their new values only when a step completes. Q is dropped on
every rank whenever the ranks may disagree on it (a recovery, a heal, a resize: :meth:`restart`),
and all draw the next one from the seed (bucket, step): a replacement rank, or a rank whose last
step a release abandoned, never multiplies by a Q the others do not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ipydist.torch._core import waiting
from ipydist.torch._wire import transport
from ipydist.torch._wire.starts import torch_group_of


@dataclass(frozen=True)
class Matrix:
    """One compressed gradient: where it lies in the bucket, its matrix shape, its rank, and
    where its P and Q lie in the exchange's buffers."""

    start: int  # in the bucket's values
    rows: int
    cols: int
    rank: int
    error_at: int  # in the error feedback (the compressed values, packed)
    p_at: int
    q_at: int


def plan(shapes: list[torch.Size], rank: int, min_compression_rate: float
         ) -> tuple[list[Matrix], list[tuple[int, int]]]:
    """Which of a bucket's gradients (``shapes``, in its order) travel compressed, and where;
    and the ``(start, numel)`` of those that travel whole."""
    matrices, whole = [], []
    start = error_at = p_at = q_at = 0
    for shape in shapes:
        numel = shape.numel()
        rows = shape[0] if len(shape) >= 2 else numel
        cols = numel // rows if len(shape) >= 2 and rows else 1
        r = min(rows, cols, rank)
        if len(shape) >= 2 and numel >= min_compression_rate * (rows + cols) * r:
            matrices.append(Matrix(start, rows, cols, r, error_at, p_at, q_at))
            error_at, p_at, q_at = error_at + numel, p_at + rows * r, q_at + cols * r
        elif numel:
            whole.append((start, numel))
        start += numel
    return matrices, whole


def orthonormalize(m: torch.Tensor) -> None:
    """Make the columns of ``m`` (n x r, n >= r) orthonormal in place, by Gram-Schmidt as DDP's
    hook does: torch operations only, so that on a GPU nothing waits for the device (a QR
    factorization may). A column of zeros (a gradient of zeros) stays zeros, not NaN."""
    work = m if m.dtype in (torch.float32, torch.float64) else m.float()
    tiny = torch.finfo(work.dtype).tiny
    for i in range(work.shape[1]):
        col = work[:, i:i + 1]
        if i:
            done = work[:, :i]
            col -= done @ (done.t() @ col)
        col /= torch.linalg.vector_norm(col).clamp_min(tiny)
    if work is not m:
        m.copy_(work)


def seeded_q(numel: int, bucket: int, step: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """A random Q every rank draws alike: seeded by the bucket and the step, never by the
    ranks' history (on the CPU, then moved: the same numbers on any device)."""
    digest = hashlib.blake2b(f"powersgd/{bucket}/{step}".encode(), digest_size=7).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return _moved(torch.randn(numel, generator=generator, dtype=torch.float32), device, dtype)


def _moved(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (on the CPU) on ``device``, without the host waiting for a GPU (from pinned
    memory): a bucket starts in a gradient hook, where backward must not wait."""
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, dtype, non_blocking=True)


class PowerSGDExchange:
    """The PowerSGD exchange of a bucket of gradients of ``shapes`` (see the module docstring)
    among ``world`` ranks; ``index``: the bucket's place in the optimizer, which seeds its
    random Q. A bucket's kept exchange (``exchanges.KeptExchange``) for
    ``Compression.powersgd``."""

    #: The key of its per-rank state in a checkpoint.
    name = "powersgd"

    def __init__(self, shapes: list[torch.Size], rank: int, min_compression_rate: float,
                 world: int, index: int = 0) -> None:
        self.numel, self.extra = sum(s.numel() for s in shapes), len(shapes)
        self.world, self.index = world, index
        self.matrices, self.whole = plan(shapes, rank, min_compression_rate)
        self.compressed = sum(m.rows * m.cols for m in self.matrices)
        self.p_numel = sum(m.rows * m.rank for m in self.matrices)
        self.q_numel = sum(m.cols * m.rank for m in self.matrices)
        #: This rank's error feedback, and Q (None: drawn at the next step); made on the
        #: first step, on the bucket's device.
        self.error: torch.Tensor | None = None
        self.q: torch.Tensor | None = None
        self._loaded: torch.Tensor | None = None  # error feedback a checkpoint gave
        self.work: Any = None
        self.mpi = False
        self._step: dict[str, Any] = {}
        self._kept: dict[str, torch.Tensor] = {}  # buffers kept between steps (_buffer)
        self.sent_bytes = 0

    @classmethod
    def for_bucket(cls, bucket: Any, compression: Any, world: int,
                   rank: int) -> PowerSGDExchange:
        return cls([p.shape for p in bucket.params], compression.rank,
                   compression.min_compression_rate, world, bucket.index)

    # --- a step ---------------------------------------------------------------------------

    def start(self, flat: torch.Tensor, step: int) -> None:
        """Start the exchange of ``flat`` (the bucket's prescaled values, then its flags)."""
        self._prepare(flat, step)
        self._launch()

    def _prepare(self, flat: torch.Tensor, step: int) -> None:
        """This rank's part before the first allreduce: what travels whole, M (the gradients
        plus the error feedback) and P = M Q."""
        dtype = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
        device = flat.device
        if self.error is None or self.error.device != device or self.error.dtype != dtype:
            self.error = (torch.zeros(self.compressed, dtype=dtype, device=device)
                          if self._loaded is None else _moved(self._loaded, device, dtype))
            self._loaded = None
        if self.q is None:
            self.q = seeded_q(self.q_numel, self.index, step, dtype, device)
        elif self.q.device != device or self.q.dtype != dtype:
            self.q = _moved(self.q, device, dtype)
        # one buffer for the first allreduce: what travels whole (then the flags), and the Ps
        whole_numel = sum(n for _, n in self.whole) + self.extra
        first = torch.empty(whole_numel + self.p_numel, dtype=dtype, device=device)
        whole, ps = first[:whole_numel], first[whole_numel:]
        torch.cat([flat[s:s + n].to(dtype) for s, n in self.whole]
                  + [flat[self.numel:].to(dtype)], out=whole)
        ms = self._buffer("m", self.compressed, dtype, device)
        qs = self.q.clone()
        for m in self.matrices:
            n = m.rows * m.cols
            mat = ms[m.error_at:m.error_at + n]
            torch.add(flat[m.start:m.start + n].to(dtype), self.error[m.error_at:m.error_at + n],
                      out=mat)
            q = _q(qs, m).t()  # cols x rank, stored transposed (see _q)
            orthonormalize(q)
            torch.matmul(mat.view(m.rows, m.cols), q, out=_p(ps, m))
        self._step = dict(first=first, whole=whole, m=ms, p=ps, q=qs)

    def _launch(self) -> None:
        """The first allreduce (what travels whole, and the Ps: one buffer) started; over MPI,
        the second (the Qs) chained behind it."""
        first, qs = self._step["first"], self._step["q"]
        self.mpi = transport.uses_mpi(first)
        if self.mpi:
            steps = (first, self._second_half) if self.matrices else (first,)
            self.work = transport.start_allreduces(*steps)
        else:
            self.work = dist.all_reduce(first, async_op=True, group=torch_group_of(None, first))
        self.sent_bytes = transport.bytes_sent(
            "allreduce", (first.numel() + qs.numel()) * first.element_size(), self.world)

    def _buffer(self, name: str, numel: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """A buffer kept between steps: a fresh one of a bucket's size each step cost more in
        page faults than the arithmetic (1.6 M values: 3 ms of a 10 ms step)."""
        kept = self._kept.get(name)
        if kept is None or kept.dtype != dtype or kept.device != device:
            kept = self._kept[name] = torch.empty(numel, dtype=dtype, device=device)
        return kept

    def _second_half(self) -> torch.Tensor:
        """Once the Ps are summed: each orthonormalized, and this rank's Qs (to be summed)."""
        ms, ps, qs = self._step["m"], self._step["p"], self._step["q"]
        for m in self.matrices:
            p = _p(ps, m)
            orthonormalize(p)
            mat = ms[m.error_at:m.error_at + m.rows * m.cols].view(m.rows, m.cols)
            torch.matmul(p.t(), mat, out=_q(qs, m))  # Q^T = P^T M
        return qs

    def progress(self) -> bool:
        """Move an MPI exchange on; True once done (gloo and NCCL: finished in ``finish``)."""
        return not self.mpi or transport.progress(self.work)

    def finish(self) -> None:
        """Wait for the exchange (a release ends the wait); on a GPU with NCCL, the waits only
        order the stream."""
        if self.mpi:
            transport.finish(self.work)
            return
        on_device = self._step["first"].device.type != "cpu"
        waiting.wait_for(self.work, on_device=on_device)
        if not self.matrices:
            return
        qs = self._second_half()
        waiting.wait_for(dist.all_reduce(qs, async_op=True, group=torch_group_of(None, qs)),
                         on_device=on_device)

    def to_read(self) -> list[torch.Tensor]:
        """The summed flags (every one: a bucket's are few, read in one go)."""
        whole = self._step["whole"]
        return list(whole[whole.numel() - self.extra:].unbind())

    def write(self, bucket: Any, flags: list, prescale: float, postscale: float,
              sparse_as_dense: bool) -> None:
        """The sum (whole values as summed, matrices as P Q^T) written into the gradients,
        and the step's error feedback and Q kept: the group is known usable here."""
        whole, ms, ps, qs = (self._step[k] for k in ("whole", "m", "p", "q"))
        assert self.error is not None  # start made it
        total = self._buffer("total", self.numel, whole.dtype, whole.device)
        at = 0
        for s, n in self.whole:
            total[s:s + n] = whole[at:at + n]
            at += n
        for m in self.matrices:
            n = m.rows * m.cols
            out = total[m.start:m.start + n].view(m.rows, m.cols)
            torch.matmul(_p(ps, m), _q(qs, m), out=out)  # P Q^T
            # M - P Q^T / N: what this rank's share of the sum did not carry
            torch.add(ms[m.error_at:m.error_at + n], out.reshape(-1), alpha=-1.0 / self.world,
                      out=self.error[m.error_at:m.error_at + n])
        self.q = qs
        self.abandon()
        bucket.write_gradients(total.split([p.numel() for p in bucket.params]),
                               [f > 0 for f in flags], postscale)

    def abandon(self) -> None:
        """Forget the step in flight (done, or void after a release): the kept state is the
        last completed step's."""
        self.work = None
        self._step = {}

    def restart(self) -> None:
        """The ranks may disagree on Q (a recovery, a heal, a resize): every rank draws the
        next one from the shared seed. The error feedback is this rank's own, and kept."""
        self.abandon()
        self.q = None

    def resized(self, world: int, rank: int) -> None:
        self.world = world
        self.restart()

    # --- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict:
        """This rank's error feedback and Q, on the CPU. Q is the same on every rank: each
        rank keeps its copy, so that a run resumed from the checkpoint on as many ranks goes
        on as the run that wrote it (on another number of ranks, nothing per rank is
        loaded)."""
        error = self.error if self.error is not None else self._loaded
        return {"error": None if error is None else error.to("cpu", copy=True),
                "q": None if self.q is None else self.q.to("cpu", copy=True)}

    def load(self, state: dict) -> None:
        self.restart()
        self.error, self._loaded = None, state.get("error")
        self.q = state.get("q")  # moved to the bucket's device by the next step


def _p(ps: torch.Tensor, m: Matrix) -> torch.Tensor:
    return ps[m.p_at:m.p_at + m.rows * m.rank].view(m.rows, m.rank)


def _q(qs: torch.Tensor, m: Matrix) -> torch.Tensor:
    """Q, kept transposed (rank x cols): ``P^T M`` and ``P Q^T`` then run in BLAS's fast
    layouts (``M^T P`` into a cols x rank Q took 6x as long on the CPU)."""
    return qs[m.q_at:m.q_at + m.cols * m.rank].view(m.rank, m.cols)
