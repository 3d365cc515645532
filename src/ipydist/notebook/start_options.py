"""``%dist_start``'s options, made from :class:`~ipydist.specs.StartOptions`: one
``@argument`` per field, in the order of the fields, with the field's help text (so
``%dist_start --help``, ``%dist_start?`` and the docs' table say what the declaration says),
and the parsed arguments back as ``StartOptions``."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from typing import Any

from IPython.core.magic_arguments import argument, magic_arguments

from ipydist.specs import StartOptions, flag_of


def _arguments(option: Field[Any]) -> list[argument]:
    """The ``@argument``\\ s of one field (a switch and its opposite are two)."""
    meta, flag = option.metadata, flag_of(option)
    if flag is None:
        return []
    if option.default is True:  # --no-init: a switch that turns the field off
        return [argument(flag, dest=option.name, action="store_false", help=meta["help"])]
    if meta["off"]:  # --elastic / --no-elastic, None when neither is given
        return [argument(flag, dest=option.name, action="store_true", default=None,
                         help=meta["help"]),
                argument(meta["off"], dest=option.name, action="store_false",
                         help=meta["off_help"])]
    if meta["many"]:  # --env K=V K=V, or given twice
        return [argument(flag, dest=option.name, nargs="+", action="extend", default=[],
                         metavar=meta["metavar"], help=meta["help"])]
    return [argument(flag, dest=option.name, default=option.default, metavar=meta["metavar"],
                     help=meta["help"])]


#: In the order ``%dist_start?`` lists them: the fields' order.
START_OPTIONS = [a for option in fields(StartOptions) for a in _arguments(option)]


def start_options(magic):
    """``magic`` with :data:`START_OPTIONS` (as ``@magic_arguments()`` and one ``@argument``
    per option, in this order, would give it)."""
    for option in reversed(START_OPTIONS):
        magic = option(magic)
    return magic_arguments()(magic)


def options_of(args: argparse.Namespace, **defaults: Any) -> StartOptions:
    """The parsed ``%dist_start`` line as :class:`StartOptions`; ``defaults`` fill the
    options the line left at None (the kernel's ``--np``)."""
    given = dict(vars(args))
    given.update({k: v for k, v in defaults.items() if given.get(k) is None})
    return StartOptions().changed(**given)
