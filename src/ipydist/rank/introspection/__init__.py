"""Looking into a rank from the notebook: pdb driven through the notebook's prompt
(``debugger``), where the rank's cell is now (``stacks``), completion and help on its names
(``completion``), and the engine's control channel that answers them while a cell runs
(``control``)."""
