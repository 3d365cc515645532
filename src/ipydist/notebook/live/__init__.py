"""Live training metrics in the notebook: the history of what rank 0 logged, the widget under the
running cell, and the static copy a saved notebook keeps. (Not called ``metrics``: that is the
user's ``ipydist.metrics()``.)"""
