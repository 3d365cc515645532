"""DistributedOptimizer's gradients on their way: the buckets they are packed in, the
exchanges that carry them (packed, in place, 1-bit), the 1-bit arithmetic (numba on the CPU,
torch operations on a GPU) and SGD's momentum kept before the quantizer."""
