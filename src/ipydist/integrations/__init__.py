"""Hooks that draw what other training frameworks log in the live metrics widget, through
``hvd.log``: :mod:`ipydist.integrations.lightning` (a Lightning logger) and
:mod:`ipydist.integrations.hf` (a Hugging Face ``TrainerCallback``). Each imports its framework,
so each is imported only by code that uses that framework; ``ipydist`` imports neither."""
