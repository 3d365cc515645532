"""Which of this host's addresses and interfaces leads to another host: the one answer both
sides need across hosts. The notebook binds the controller there (never every interface when
one serves); a rank sets ``GLOO_SOCKET_IFNAME`` to it, and rank 0 gives
its address there as the rendezvous address. Stdlib and psutil only; imported by both sides.

The kernel's routing table answers, without a packet sent: a UDP socket "connected" to the
other host is given the source address the kernel would use to reach it.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """This host's side of the way to other hosts."""

    address: str  # the local address packets to them leave from
    interface: str  # its interface (``eth0``), for GLOO_SOCKET_IFNAME
    network: str  # its network as a CIDR (``10.0.0.0/24``), for MPI's if_include options

    def __str__(self) -> str:
        return f"{self.address} ({self.interface})"


def resolve(host: str) -> str:
    """The IPv4 address ``host`` resolves to (OSError if it does not)."""
    address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    assert isinstance(address, str)  # AF_INET's sockaddr: (address, port)
    return address


def source_address(host: str) -> str:
    """The local address the kernel would send from to reach ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve(host), 9))  # UDP: no packet leaves; only the route is chosen
        return s.getsockname()[0]


def route_to(host: str) -> Route:
    """The :class:`Route` (address, interface, network) that reaches ``host``."""
    address = source_address(host)
    interface, network = interface_of(address)
    return Route(address, interface, network)


def interface_of(address: str) -> tuple[str, str]:
    """(interface name, network CIDR) of a local address."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and a.address == address:
                mask = a.netmask or "255.255.255.255"
                network = ipaddress.ip_network(f"{address}/{mask}", strict=False)
                return name, str(network)
    raise OSError(f"no interface of this host has the address {address}")


def is_local(host: str) -> bool:
    """Whether ``host`` names this host (its name, ``localhost``, or one of its addresses)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = resolve(host)
    except OSError:
        return False
    if ipaddress.ip_address(address).is_loopback:
        return True
    import psutil

    return any(a.address == address for addrs in psutil.net_if_addrs().values() for a in addrs)
