"""Debugging a rank from the notebook: pdb driven through the notebook's prompt
(``debugger``), where the rank's cell is now (``stacks``), and the engine's control channel
that answers both while a cell runs (``control``)."""
