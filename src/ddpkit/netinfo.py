"""Which of this host's interfaces and addresses reach another host; no torch import.

gloo advertises the address its hostname resolves to unless ``GLOO_SOCKET_IFNAME`` names an interface; on many
machines (Debian's ``127.0.1.1 hostname`` line, containers) that is a loopback address the other hosts cannot
reach. The interface the kernel would use to reach the master is the right one, and the kernel can tell us.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["InterfaceChoice", "gloo_interface", "interface_addresses", "is_local_address", "resolve", "route_to"]

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's primary IPv4 address


def resolve(host: str) -> str:
    """The first address ``host`` resolves to (an address is returned as it is); OSError if it does not resolve."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    if not infos:
        raise OSError(f"{host} does not resolve")
    return str(infos[0][4][0])


def _ipv4_addresses() -> dict[str, str]:
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def _ipv6_addresses() -> list[tuple[str, str]]:
    path = Path("/proc/net/if_inet6")
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6:
            raw = parts[0]
            out.append((parts[5], str(ipaddress.ip_address(":".join(raw[i:i + 4] for i in range(0, 32, 4))))))
    return out


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, address) for every interface with an address: IPv4 primary addresses, then IPv6."""
    return [*_ipv4_addresses().items(), *_ipv6_addresses()]


def is_local_address(addr: str) -> bool:
    """True when ``addr`` (an address, not a name) is loopback or assigned to one of this host's interfaces."""
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or any(ipaddress.ip_address(a) == ip for _, a in interface_addresses())


def route_to(addr: str) -> tuple[str, str]:
    """The interface and local address this host uses to reach ``addr`` (a host name or an address).

    Asks the kernel's routing table (a UDP connect sends nothing), then names the interface that holds the
    chosen source address. For one of this host's own addresses that is the interface holding it, not ``lo``.
    Raises OSError when ``addr`` does not resolve or no route reaches it.
    """
    target = resolve(addr)
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))  # the discard port; no packet leaves
        local = str(s.getsockname()[0]).split("%")[0]
    local_ip = ipaddress.ip_address(local)
    for name, address in interface_addresses():
        if ipaddress.ip_address(address) == local_ip:
            return name, local
    if local_ip.is_loopback:
        return "lo", local
    raise OSError(f"the route to {addr} leaves from {local}, which no interface of this host holds")


@dataclass(frozen=True, kw_only=True)
class InterfaceChoice:
    """The interface gloo uses to reach the other ranks, and why."""

    ifname: str | None
    """Interface name (GLOO_SOCKET_IFNAME); None where gloo is left to its default (the hostname's address)."""
    local_ip: str | None
    """This host's address on that interface, where known."""
    chosen_by_ddpkit: bool
    """True when ddpkit set GLOO_SOCKET_IFNAME; False when the user did, or nothing needed setting."""
    reason: str
    """One sentence for reports: why this interface."""


def gloo_interface(master_addr: str | None, environ: Mapping[str, str]) -> InterfaceChoice:
    """Decide GLOO_SOCKET_IFNAME: the user's value if set; else, for a master on another host, the interface
    that routes to it; else (no master, or a loopback master: one host) gloo's default."""
    user = environ.get("GLOO_SOCKET_IFNAME")
    if user:
        return InterfaceChoice(ifname=user, local_ip=None, chosen_by_ddpkit=False,
                               reason=f"GLOO_SOCKET_IFNAME={user} was set before ddpkit started")
    if not master_addr:
        return InterfaceChoice(ifname=None, local_ip=None, chosen_by_ddpkit=False,
                               reason="no master address: gloo uses the address of this host's name")
    try:
        master_ip = resolve(master_addr)
    except OSError as exc:
        return InterfaceChoice(ifname=None, local_ip=None, chosen_by_ddpkit=False,
                               reason=f"the master {master_addr} does not resolve ({exc}): gloo left to its default")
    if ipaddress.ip_address(master_ip).is_loopback:
        return InterfaceChoice(ifname=None, local_ip=None, chosen_by_ddpkit=False,
                               reason=f"the master {master_addr} is loopback ({master_ip}): all ranks on this host")
    try:
        ifname, local_ip = route_to(master_ip)
    except OSError as exc:
        return InterfaceChoice(ifname=None, local_ip=None, chosen_by_ddpkit=False,
                               reason=f"no route to the master {master_addr} ({exc}): gloo left to its default")
    shown = master_addr if master_addr == master_ip else f"{master_addr} ({master_ip})"
    return InterfaceChoice(ifname=ifname, local_ip=local_ip, chosen_by_ddpkit=True,
                           reason=f"{ifname} ({local_ip}) is the interface that routes to the master {shown}")
