"""One line of ``ipydist doctor``'s report: a :class:`Check` and its three statuses. Its own
module so that the checks of this host (``doctor.py``) and of other hosts (``hostcheck.py``)
share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

OK, FAIL, NOTE = "OK", "FAIL", "NOTE"


@dataclass
class Check:
    status: str
    name: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.status:<4}  {self.name:<18} {self.detail}{fix}"
