"""What a framework logged, as the plain numbers ``hvd.log`` takes (pure logic)."""

from __future__ import annotations

import numbers as _numbers


def numbers(logged: dict) -> dict[str, float]:
    """The entries of ``logged`` that are single numbers (a Python number, or a tensor or
    array of one element), as floats; text, flags, lists and the like are left out."""
    out = {}
    for name, value in logged.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, _numbers.Real):
            out[name] = float(value)
            continue
        item = getattr(value, "item", None)
        size = getattr(value, "numel", None) or getattr(value, "size", None)
        count = size() if callable(size) else size
        if item is not None and count == 1:
            number = item()
            if isinstance(number, _numbers.Real) and not isinstance(number, bool):
                out[name] = float(number)
    return out
