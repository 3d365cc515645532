"""The notebook side: everything here runs in the Jupyter kernel, and none of it imports torch.

``cluster`` starts and owns the controller and mpiexec's ranks; ``cell`` runs one
``%%everyrank`` cell (with ``iopub``, ``lines``, ``stall`` and ``recovery``); ``live/`` shows the
ranks' metrics. What crosses to the ranks is in :mod:`ipydist.protocol`.
"""
