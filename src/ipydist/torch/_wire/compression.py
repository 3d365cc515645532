"""Gradient compression for the allreduce, with Horovod's names.

A compressor turns a gradient buffer into what travels over the wire and back again:
``compress(tensor) -> (wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx) -> tensor``.
Casting to 16 bits halves the bytes every allreduce moves; the sum is taken in 16 bits, which is
what Horovod's ``Compression.fp16`` does and what mixed-precision training (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018) shows gradients tolerate. bf16 keeps fp32's exponent
range, so large sums do not overflow, at the cost of mantissa bits.
"""

from __future__ import annotations

import torch

from ipydist.errors import InvalidArgument


class Compressor:
    """No compression: the buffer travels as it is."""

    wire_dtype: torch.dtype | None = None
    #: Whether the compressed buffers are summed by the ranks (1-bit messages cannot be added
    #: on the wire) instead of reduced by the allreduce.
    summed_by_ranks = False

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if cls.wire_dtype is None or not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class NoneCompressor(Compressor):
    """Send gradients in their own dtype."""


class FP16Compressor(Compressor):
    """Send floating-point gradients as float16."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Send floating-point gradients as bfloat16."""

    wire_dtype = torch.bfloat16


class OneBitCompressor(Compressor):
    """1-bit SGD with error feedback (Seide et al. 2014;
    :mod:`ipydist.torch.training.gradients.onebit`): each rank sends one bit per gradient value
    plus two bfloat16 reconstruction values per group of 64 (summed by the owner of each
    stripe, not on the wire), and keeps what it did not send for the next step; SGD's momentum
    is kept per rank before the quantizer
    (:mod:`ipydist.torch.training.gradients.momentum_correction`). DistributedOptimizer only:
    the exchange is an all-to-all then an allgather of 1-bit messages, not an allreduce."""

    summed_by_ranks = True

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """Refused: a single collective has nowhere to keep the error feedback, and sending
        the tensor in full precision instead would hide that the ask was not met."""
        raise InvalidArgument(
            "Compression.onebit works only in DistributedOptimizer: 1-bit SGD keeps what each "
            "rank did not send (its error feedback) from one step to the next, per gradient, "
            "which a single collective has nowhere to keep. Here use Compression.fp16 or "
            ".bf16, or train with hvd.DistributedOptimizer(opt, "
            "compression=hvd.Compression.onebit).")


class Compression:
    """``Compression.none``, ``.fp16``, ``.bf16``, and ``.onebit`` (DistributedOptimizer)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    onebit = OneBitCompressor
