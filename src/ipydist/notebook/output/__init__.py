"""What a cell shows: what the ranks send, collected from IOPub (``iopub``), their printed lines
merged (``lines``), their rich output tagged (``rich``), and showing it all in the notebook
(``display``). The cell loop (:mod:`ipydist.notebook.cell`) drives them.
"""
