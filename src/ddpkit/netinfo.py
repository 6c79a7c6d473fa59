"""Which network interface this host uses to reach an address (no torch import).

gloo and NCCL pick an interface from the host name unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say
otherwise; when the host name resolves to loopback, ranks advertise 127.0.0.1 and a multi-node run hangs.
``route_to(master)`` answers what the kernel's routing table would do, without sending a packet::

    >>> route_to("127.0.0.1")
    ('lo', '127.0.0.1')
"""

from __future__ import annotations

import fcntl
import ipaddress
import shutil
import socket
import struct
import subprocess

__all__ = ["interface_addresses", "route_to"]

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


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
    """Every interface's IPv4 and IPv6 addresses, by interface name (from ioctl and /proc/net/if_inet6)."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            out.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
    for name, ip in _ipv6_addresses():
        out.setdefault(name, []).append(ip)
    return out


def _ipv6_addresses() -> list[tuple[str, str]]:
    try:
        with open("/proc/net/if_inet6") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            found.append((fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))))
    return found


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
