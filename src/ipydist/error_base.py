"""The one base class of every error ipydist raises, alone in the lowest module of the
package: :mod:`ipydist.specs` (which raises :class:`~ipydist.specs.SpecError`) and
:mod:`ipydist.errors` (which words its messages with specs' rank lists) both derive from it,
as do the rank side's errors. Stdlib only: both sides of the wire import it.

Each error also derives from the built-in error Python would raise in its place
(``ValueError`` for bad input, ``TimeoutError`` for a deadline, ``RuntimeError`` for a broken
cluster), so ``except ValueError`` keeps working where code wrote it before ipydist."""

from __future__ import annotations


class IpydistError(Exception):
    """Raised by ipydist, never by the code of a cell (that arrives as
    :class:`~ipydist.errors.RankError`, which is one too): ``except ipydist.IpydistError``
    catches what ipydist itself has to say. An interrupt (the stop button) is not an error:
    it stays a ``KeyboardInterrupt``, so ``except Exception`` never swallows a stop."""
