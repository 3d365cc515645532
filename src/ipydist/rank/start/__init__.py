"""How a rank comes to be: forked from its host's fork server (``forkserver``), set up before
it becomes an engine (``bootstrap``), or spawned to replace a dead rank (``replacement``)."""
