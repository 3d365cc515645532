"""Horovod's API, by the names Horovod code types (re-exported by :mod:`ipydist.torch`):
``basics`` (init, rank, size, ...), ``collectives``, ``async_ops``, ``functions`` (objects,
parameters, optimizer state), ``process_sets``, ``join``, ``timeline``, ``autograd``,
``sync_batch_norm``. Builds on ``_core``, ``_wire`` and ``_mpi``; never on ``training``.
"""
