"""Shaped links for the namespace test hosts (netns_hosts.py): each host's ``eth0`` sends at
most ``rate``, ``delay`` later, as a cluster's network would, instead of at memory speed over a
veth pair.

The shaping is a ``tc`` queueing discipline on the host's ``eth0`` (its egress: what it sends),
so a transfer from one host to another meets the sender's rate and delay once, and a
round trip twice the delay. With ``sch_netem`` in the kernel, ``netem`` does both
(``rate R delay D [J]``); without it (this project's CI machines, whose kernels have no
``netem``), ``tbf`` limits the rate and no delay is added: :func:`shape` says which it did.
Nothing is left behind: the qdisc lives on the host's device, which goes with its namespace.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

#: netem's queue, in packets: at 10 Gbit/s with 64 KB segments the default (1000) drops.
NETEM_LIMIT = 100_000
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Link:
    """``rate`` in tc's words (``1gbit``, ``10gbit``, ``200mbit``); ``delay`` and ``jitter``
    too (``0.2ms``), applied where the kernel has ``netem``."""

    rate: str
    delay: str | None = None
    jitter: str | None = None

    @property
    def bits_per_second(self) -> float:
        found = re.fullmatch(r"([0-9.]+)([kmg]?)bit", self.rate.lower())
        if not found:
            raise ValueError(f"rate {self.rate!r}: expected e.g. 1gbit, 200mbit")
        return float(found.group(1)) * _UNITS[found.group(2)]


def shape(netns: str, link: Link, device: str = "eth0") -> str:
    """Shape ``device`` of namespace ``netns``; returns the qdisc made (``netem`` or ``tbf``)."""
    netem = ["netem", "rate", link.rate, "limit", str(NETEM_LIMIT)]
    if link.delay:
        netem += ["delay", link.delay, *([link.jitter] if link.jitter else [])]
    made = _tc(netns, "qdisc", "replace", "dev", device, "root", *netem)
    if made.returncode == 0:
        return "netem"
    if "unknown" not in made.stderr.lower():
        raise RuntimeError(f"tc netem on {netns}: {made.stderr.strip()}")
    # a burst of at least 1 ms at the rate, and more than one 64 KB (GSO) segment
    burst = max(int(link.bits_per_second / 8 / 1000), 256 * 1024)
    made = _tc(netns, "qdisc", "replace", "dev", device, "root", "tbf", "rate", link.rate,
               "burst", str(burst), "latency", "100ms")
    if made.returncode != 0:
        raise RuntimeError(f"tc tbf on {netns}: {made.stderr.strip()}")
    return "tbf"


def qdisc(netns: str, device: str = "eth0") -> str:
    """What ``tc qdisc show`` says of ``device`` in ``netns``."""
    return _tc(netns, "qdisc", "show", "dev", device).stdout.strip()


def _tc(netns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", "-n", netns, *args], capture_output=True, text=True, timeout=30)
