"""Gradient compression for the allreduce, with Horovod's names.

A compressor turns a gradient buffer into what travels over the wire and back again:
``compress(tensor) -> (wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx) -> tensor``.
Casting to 16 bits halves the bytes every allreduce moves; the sum is taken in 16 bits, which is
what Horovod's ``Compression.fp16`` does and what mixed-precision training (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018) shows gradients tolerate. bf16 keeps fp32's exponent
range, so large sums do not overflow, at the cost of mantissa bits.

A compression that keeps state from one step to the next (error feedback: 1-bit SGD, PowerSGD)
cannot be a cast around one collective: it names the exchange that carries it in
``DistributedOptimizer``'s buckets (:mod:`ipydist.torch.training.gradients.exchanges`), which
keeps that state, and its parameters, if it has any, make it an instance
(``Compression.powersgd(rank=4)``) where the casts are classes, as Horovod has them. A new
compression is a module holding its exchange, and a class here that names it.
"""

from __future__ import annotations

import torch

from ipydist.errors import InvalidArgument


class Compressor:
    """No compression: the buffer travels as it is."""

    wire_dtype: torch.dtype | None = None
    #: The exchange that carries it in DistributedOptimizer's buckets, as "module:Class"
    #: (imported when first used: the exchanges sit above this module); None: one allreduce
    #: of the packed bucket, through :meth:`compress` and :meth:`decompress`.
    exchange: str | None = None
    #: Whether each rank keeps SGD's momentum of its own gradients before the exchange
    #: (1-bit's momentum correction) instead of the optimizer applying it to the average.
    keeps_momentum = False
    #: Steps averaged in full precision before it starts (PowerSGD's ``start_iter``).
    full_precision_steps = 0

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if cls.wire_dtype is None or not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


#: What ``compression=`` takes: a class (the casts, and compressors written for Horovod) or an
#: instance (a compression with parameters).
AnyCompressor = type[Compressor] | Compressor


class NoneCompressor(Compressor):
    """Send gradients in their own dtype."""


class FP16Compressor(Compressor):
    """Send floating-point gradients as float16."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Send floating-point gradients as bfloat16."""

    wire_dtype = torch.bfloat16


class KeptStateCompressor(Compressor):
    """A compression whose exchange keeps state per gradient between steps (its error
    feedback): DistributedOptimizer only."""

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Refused: a single collective has nowhere to keep the error feedback, and sending
        the tensor in full precision instead would hide that the ask was not met."""
        name = _NAMES.get(cls, cls.__name__)
        raise InvalidArgument(
            f"{name} works only in DistributedOptimizer: it keeps what each rank did not send "
            "(its error feedback) from one step to the next, per gradient, which a single "
            "collective has nowhere to keep. Here use Compression.fp16 or .bf16, or train with "
            f"hvd.DistributedOptimizer(opt, compression=hvd.{name}).")


class OneBitCompressor(KeptStateCompressor):
    """1-bit SGD with error feedback (Seide et al. 2014;
    :mod:`ipydist.torch.training.gradients.onebit`): each rank sends one bit per gradient value
    plus two bfloat16 reconstruction values per group of 64 (summed by the owner of each
    stripe, not on the wire), and keeps what it did not send for the next step; SGD's momentum
    is kept per rank before the quantizer
    (:mod:`ipydist.torch.training.gradients.momentum_correction`). The exchange is an
    all-to-all then an allgather of 1-bit messages, not an allreduce."""

    exchange = "ipydist.torch.training.gradients.onebit_exchange:OneBitExchange"
    keeps_momentum = True


class PowerSGDCompressor(KeptStateCompressor):
    """PowerSGD (Vogels, Karimireddy and Jaggi 2019;
    :mod:`ipydist.torch.training.gradients.powersgd`): each gradient matrix travels as two
    matrices of ``rank`` columns, with error feedback and a warm-started Q, after
    ``start_iter`` steps of full precision, as DDP's ``powerSGD_hook`` does; vectors, and
    matrices that would shrink less than ``min_compression_rate`` times, travel whole."""

    exchange = "ipydist.torch.training.gradients.powersgd:PowerSGDExchange"

    def __init__(self, rank: int = 1, start_iter: int = 10,
                 min_compression_rate: float = 2.0) -> None:
        for name, value, least in (("rank", rank, 1), ("start_iter", start_iter, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise InvalidArgument(
                    f"Compression.powersgd: {name} must be a whole number, {least} or more, "
                    f"not {value!r} (e.g. Compression.powersgd(rank=4, start_iter=10))")
        if not isinstance(min_compression_rate, (int, float)) or min_compression_rate <= 0:
            raise InvalidArgument(
                "Compression.powersgd: min_compression_rate must be a number above 0 (a matrix "
                "is compressed where n m >= rate (n + m) rank), not "
                f"{min_compression_rate!r}")
        self.rank, self.start_iter = rank, start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.full_precision_steps = start_iter

    def __repr__(self) -> str:
        return (f"Compression.powersgd(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate:g})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PowerSGDCompressor) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))


class Compression:
    """``Compression.none``, ``.fp16``, ``.bf16``; for DistributedOptimizer also ``.onebit``
    and ``.powersgd(rank=1, start_iter=10)``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    onebit = OneBitCompressor
    powersgd = PowerSGDCompressor


_NAMES: dict[type, str] = {NoneCompressor: "Compression.none", FP16Compressor: "Compression.fp16",
                           BF16Compressor: "Compression.bf16",
                           OneBitCompressor: "Compression.onebit"}


def describe(compression: AnyCompressor) -> str:
    """The name the user gave (``Compression.fp16``, ``Compression.powersgd(rank=4, ...)``, a
    class's own name): in messages, and in the step's check, where ranks given different
    compressions (or parameters) differ."""
    if isinstance(compression, type):
        return _NAMES.get(compression, compression.__name__)
    return repr(compression)


def is_compressor(value: object) -> bool:
    return (isinstance(value, type) and issubclass(value, Compressor)) or isinstance(
        value, Compressor)


def sends_as_is(compression: AnyCompressor) -> bool:
    """Whether gradients travel exactly as they are (``Compression.none``)."""
    return compression is NoneCompressor
