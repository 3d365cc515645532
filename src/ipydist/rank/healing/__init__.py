"""A rank's part in ``--elastic``'s heals and ``Session.scale``: the world made again around
the survivors (``heal``), rank 0's state pickled for the replacements and loaded there
(``state_copy``), and the bytes of its tensors carried to them (``state_transfer``)."""
