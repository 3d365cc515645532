"""What a replacement holds under the name of a variable a heal could not copy to it.

Without it, the next cell that uses the name raises ``NameError`` on the replacement alone,
while the other ranks run it: a rank that looks as if it had lost its state. The stand-in
says what happened instead, on first use, naming the variable and why it was not copied, so
the user knows to make it again (on every rank: an ``%%everyrank`` cell).
"""

from __future__ import annotations

from ipydist.error_base import IpydistError


class NotCopiedError(IpydistError, NameError):
    """A variable a heal could not copy to this rank (see :class:`NotCopied`) was used."""


class NotCopied:
    """Stands for the variable ``name`` that a heal could not copy to this rank, and says so
    on any use but its ``repr``."""

    __slots__ = ("_ipydist_name", "_ipydist_why")

    def __init__(self, name: str, why: str) -> None:
        object.__setattr__(self, "_ipydist_name", name)
        object.__setattr__(self, "_ipydist_why", why)

    def _refuse(self, *_args, **_kwargs):
        name = object.__getattribute__(self, "_ipydist_name")
        why = object.__getattribute__(self, "_ipydist_why")
        raise NotCopiedError(
            f"{name} was not copied to this rank when it replaced a dead one ({why}); the "
            f"other ranks kept theirs. Make it again on every rank (an %%everyrank cell that "
            f"assigns {name}).")

    def __getattr__(self, attribute):
        self._refuse()

    def __repr__(self) -> str:
        name = object.__getattribute__(self, "_ipydist_name")
        why = object.__getattribute__(self, "_ipydist_why")
        return f"<{name}: not copied to this rank in a heal ({why})>"

    __setattr__ = __call__ = __iter__ = __next__ = __len__ = __getitem__ = _refuse
    __setitem__ = __contains__ = __bool__ = __enter__ = __exit__ = _refuse
    __add__ = __sub__ = __mul__ = __truediv__ = __matmul__ = _refuse
