"""Launching a cluster's ranks: which hosts (``hosts``), the mpiexec command and reading its
reports (``mpiexec``), ``--launcher slurm`` (``slurm``), following a start as it happens
(``startup``), and watching and ending the processes (``processes``).
:class:`~ipydist.notebook.cluster.Cluster` carries these plans out.
"""
