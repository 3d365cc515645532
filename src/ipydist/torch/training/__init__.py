"""Training algorithms over the collectives: ``optimizer`` (DistributedOptimizer, its
``optimizer_options``, ``wrapping`` and gradient ``buckets``), 1-bit SGD (``onebit``,
``onebit_kernels``, ``onebit_exchange``, ``momentum_correction``), PowerSGD (``powersgd``),
block momentum (``block_momentum``), ``checkpoint``, ``data`` (shards, scale_lr) and
``metrics`` (``log()``, batched by ``batching``). The top layer of torch/: nothing in it is
imported from below.
"""
