"""Which network interface this host uses to reach an address (no torch import).

gloo and NCCL pick an interface from the host name unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say
otherwise; when the host name resolves to loopback, ranks advertise 127.0.0.1 and a multi-node run hangs.
``route_to(master)`` answers what the kernel's routing table would do, without sending a packet::

    >>> route_to("127.0.0.1")
    ('lo', '127.0.0.1')
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["InterfaceChoice", "gloo_interface", "interface_addresses", "is_local_address", "resolve", "route_to"]

def route_to(addr: str, port: int = 9) -> tuple[str | None, str]:
    """Return ``(interface name, local IP)`` the kernel would use to send to ``addr`` (a host name or IP).

    A UDP ``connect`` only consults the routing table (no packet leaves), and ``getsockname`` then gives the
    source address; the interface is the one holding that address. The name is None when no interface can be
    matched (rare: e.g. an address owned by a VRF this process cannot see). Raises OSError when ``addr`` does
    not resolve or no route exists.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        local_ip = str(s.getsockname()[0])
    return _interface_of(local_ip) or _ip_route_get(str(sockaddr[0])), local_ip


def interface_addresses() -> dict[str, list[str]]:
    """Every interface's IPv4 and IPv6 addresses, by interface name (psutil: portable beyond Linux); an IPv6
    address without its ``%scope`` suffix; interfaces without an address are left out."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        if ips:
            out[name] = ips
    return out


def _interface_of(local_ip: str) -> str | None:
    wanted = ipaddress.ip_address(local_ip.split("%", 1)[0])
    for name, ips in interface_addresses().items():
        if any(ipaddress.ip_address(ip) == wanted for ip in ips):
            return name
    return None


def _ip_route_get(dest: str) -> str | None:
    """Fallback: ``ip route get DEST`` names the device (``... dev eth0 src 10.0.0.2 ...``)."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        text = subprocess.run([ip, "route", "get", dest], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = text.split()
    return words[words.index("dev") + 1] if "dev" in words[:-1] else None


def resolve(host: str) -> str:
    """The first address ``host`` resolves to (an address is returned as it is); OSError if it does not resolve."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])


def is_local_address(addr: str) -> bool:
    """True when ``addr`` (an address, not a name) is loopback or held by one of this host's interfaces."""
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    return ip.is_loopback or any(ipaddress.ip_address(a.split("%", 1)[0]) == ip
                                 for ips in interface_addresses().values() for a in ips)


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
        if ifname is None:
            raise OSError(f"no interface holds {local_ip}")
    except OSError as exc:
        return InterfaceChoice(ifname=None, local_ip=None, chosen_by_ddpkit=False,
                               reason=f"no route to the master {master_addr} ({exc}): gloo left to its default")
    shown = master_addr if master_addr == master_ip else f"{master_addr} ({master_ip})"
    return InterfaceChoice(ifname=ifname, local_ip=local_ip, chosen_by_ddpkit=True,
                           reason=f"{ifname} ({local_ip}) is the interface that routes to the master {shown}")
