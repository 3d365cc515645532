"""How one collective call moves: the per-call ``call_check`` of its ``signature`` with the
other ranks, the ``transport`` (MPI or the process group), the ``starts`` every collective is
built on and the ``handles`` of those in flight, the reductions (``reduce_ops``, ``adasum``)
and gradient ``compression``. Builds on :mod:`ipydist.torch._core` only.
"""
