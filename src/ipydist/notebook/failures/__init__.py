"""What the notebook side does when ranks fail: the recovery after a failed or interrupted cell
(``recovery``), the heal of a dead rank under ``--elastic`` (``healing``), stall warnings
(``stall``), and the watchdog that ends a cluster whose kernel is gone (``watchdog``)."""
