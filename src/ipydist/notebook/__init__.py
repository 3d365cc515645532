"""The notebook side: everything here runs in the Jupyter kernel, and none of it imports torch.

``cluster`` starts and owns the controller and mpiexec's ranks, with ``launch/`` (hosts, the
mpiexec or Slurm plan, following a start, the processes) and ``watchdog``; ``cell`` runs one
``%%everyrank`` cell (with ``output/`` for what the ranks send and what the cell shows, ``stall``
and ``recovery``); ``live/`` shows the ranks' metrics; ``reopen/`` keeps the last cells'
output for a page that opens the notebook again. What crosses to the ranks is in
:mod:`ipydist.protocol`.
"""
