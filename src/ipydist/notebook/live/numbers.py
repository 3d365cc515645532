"""Numbers written the way a person writes them: ``200,000 steps``, ``1.5``, ``0.01``,
``190 k steps/s``.

The widget (``numbers.js``) has the same four functions under the same names, and both are
tested on one table of cases (``tests/data/numbers.json``), so the live chart, its static copy
and the text summary never disagree about how a number looks.

- :func:`number`: a measured value. Three significant digits, no trailing zeros; from 10,000
  up with a k/M/G/T suffix, under 0.001 in scientific notation (``1.2e-4``).
- :func:`count`: something counted (steps, points, samples): whole, with thousands separators.
- :func:`tick_labels`: axis labels, each as :func:`number` writes it, with more digits only
  where the labels would otherwise repeat.
- :func:`duration`: seconds as a clock reads them: ``0:42``, ``12:05``, ``1:02:03``.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

MISSING = "–"
_SUFFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def number(v, digits: int = 3) -> str:
    """A measured value in ``digits`` significant digits, as a person would write it."""
    if v is None or not math.isfinite(v):
        return MISSING
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4:
        for scale, suffix in _SUFFIXES:
            if a >= scale * (1 - 0.5 * 10 ** -digits):  # 999,999 is 1 M, not 1,000 k
                return f"{_significant(v / scale, digits)} {suffix}"
    if a >= 10 ** digits:  # 1,234: whole, however many digits were asked for
        return _fixed(v, 0)
    if a < 1e-3:
        exponent = math.floor(math.log10(a))
        mantissa = _fixed(v / 10**exponent, digits - 1)
        if abs(float(mantissa)) >= 10:  # 9.996e-4 -> 1e-3
            exponent, mantissa = exponent + 1, _fixed(v / 10 ** (exponent + 1), digits - 1)
        return f"{_strip(mantissa)}e{int(exponent)}"
    return _significant(v, digits)


def count(v) -> str:
    """Something counted: ``200,000``; a fractional value is written as :func:`number` does."""
    if v is None or not math.isfinite(v):
        return MISSING
    if float(v).is_integer():
        return f"{int(v):,}"
    return number(v)


def tick_labels(values: list[float]) -> list[str]:
    """Labels for axis ticks: as short as :func:`number` makes them, but never two alike."""
    for digits in range(3, 10):
        labels = [number(v, digits) for v in values]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def duration(seconds) -> str:
    """Seconds as ``0:42``, ``12:05`` or ``1:02:03``, rounded to the second (ties up)."""
    if seconds is None or not math.isfinite(seconds):
        return MISSING
    s = math.floor(seconds + 0.5)
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _significant(v: float, digits: int) -> str:
    """``v`` rounded to ``digits`` significant digits, in fixed notation, zeros stripped."""
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    text = _fixed(v, decimals)
    if decimals and abs(float(text.replace(",", ""))) >= 10 ** (digits - decimals):
        text = _fixed(v, decimals - 1)  # rounding carried into a new digit: 9.996 -> 10.0
    return _strip(text)


def _fixed(v: float, decimals: int) -> str:
    """``v`` with ``decimals`` decimals and thousands separators, rounded from its shortest
    decimal form (2.675, not the binary 2.67499...) with ties away from zero
    (as the browser's ``toLocaleString`` does, so both sides agree)."""
    step = Decimal(1).scaleb(-decimals)
    return f"{Decimal(repr(float(v))).quantize(step, rounding=ROUND_HALF_UP):,}"


def _strip(text: str) -> str:
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text
