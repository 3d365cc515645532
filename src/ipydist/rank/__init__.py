"""The rank side: everything here runs in a rank process, started by mpiexec as
``python -m ipydist.rank``.

``bootstrap`` sets the rank up (device, threads, process group) before it becomes an
ipyparallel engine; ``watcher`` releases it from a collective that cannot complete and reports
long waits; ``calls`` holds the functions the notebook runs on every rank; ``channel`` sends data
messages to the notebook. What ``%%everyrank`` cells call is in :mod:`ipydist.torch`.
"""
