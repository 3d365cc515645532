"""The rank's runtime under the collectives: where this rank stands (``topology``), the default
process group's life (``process_group``), the rendezvous ``store``, ``retired`` groups, the
``shims`` around user calls of torch.distributed, ``waiting`` that a release can end, ``marks``
on ipydist's waits, the timeline's ``events``, and ``resync`` after a recovery.

Imports only the standard library, torch, mpi4py, psutil and ipydist's shared modules
(protocol, specs, errors): every other package of torch/ builds on this one.
"""
