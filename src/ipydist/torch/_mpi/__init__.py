"""``--backend mpi``: a torch.distributed backend over mpi4py (``backend``) and the progress
thread that moves its nonblocking collectives (``progress``). Builds on ``_core`` and
``_wire``.
"""
