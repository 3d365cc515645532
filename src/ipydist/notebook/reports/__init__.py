"""What the notebook shows of the ranks when asked: ``%dist_status``'s table (``status``) and
``%dist_timeline`` (``timeline``, with its time axis in ``timeline_axis``). The views that update
themselves while cells run are in ``live/``."""
