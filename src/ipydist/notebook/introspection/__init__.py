"""Looking into the ranks from the notebook: their stacks and pdb (``debugging``), completion
and help from their names (``completion``), asked on the engines' control channel, which
answers while a cell runs (``control``)."""
