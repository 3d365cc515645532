"""DistributedOptimizer's gradients on their way: the buckets they are packed in, the
exchanges that carry them (packed, in place, a compression's own: 1-bit, PowerSGD), the 1-bit
arithmetic (numba on the CPU, torch operations on a GPU) and SGD's momentum kept before the
quantizer."""
