"""A survivor blocked in a collective with ranks whose node went silent is set free.

A killed rank's kernel closes its sockets: its peers' collectives fail at once ("Connection reset by peer") and they
ask the agent (``LiveGroup.lost_peer``). A node cut off from the network closes nothing that reaches them: their
collective waits on a connection that will never speak again, until the group's timeout (30 minutes by default).
The agent finds such a node by its ranks' pulses standing still and writes the next generation's plan; a survivor
still in the old generation ``UNBLOCK_AFTER_S`` after that plan appeared shuts its own TCP connections to the lost
ranks' hosts (``shutdown(2)``: as a reset from the far side would), so the collective fails as it would for a killed
peer and the rank goes on as one whose peer was killed. Only connections to those hosts' addresses are touched,
never a store's, nor any other host's (a script's own connections elsewhere are left alone).

The connections are this process's sockets (``/proc/self/fd``) whose far end, in the kernel's table
(``/proc/self/net/tcp``, ``tcp6``), is one of the hosts' addresses.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable, Iterable

from ddpkit.base.background import BackgroundLoop
from ddpkit.base.log import get_logger
from ddpkit.live.protocol import LiveStore, Plan

__all__ = ["UNBLOCK_AFTER_S", "Unblocker", "addresses_of", "shut_connections_to"]

log = get_logger(__name__)

#: How long a survivor may stay in the old generation after the next one's plan appeared before its connections to
#: the lost hosts are shut (seconds): a survivor whose peer was killed has asked long before.
UNBLOCK_AFTER_S = 0.5
#: How often the plan is looked for (seconds).
LOOK_S = 0.25
_ESTABLISHED = "01"


def addresses_of(hosts: Iterable[str]) -> set[str]:
    """Every address the names resolve to (a name that does not resolve gives none)."""
    found: set[str] = set()
    for host in hosts:
        try:
            found.update(str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP))
        except OSError:
            continue
    return found


def _remote(field: str) -> str:
    """The address of a ``/proc/net/tcp*`` column (``HEX:PORT``, each 32-bit word in host order), as text; an
    IPv4-mapped IPv6 address as its IPv4."""
    hexed = field.split(":", 1)[0]
    raw = b"".join(int(hexed[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(hexed), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def shut_connections_to(addresses: set[str], *, spare_ports: Iterable[int] = ()) -> int:
    """Shut this process's established TCP connections whose far end is one of ``addresses`` (but for those to
    ``spare_ports`` there: the agent's stores); how many."""
    spared = {f"{port:04X}" for port in spare_ports}
    sockets: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            sockets[link[8:-1]] = int(name)
    shut = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != _ESTABLISHED or cols[9] not in sockets:
                continue
            if _remote(cols[2]) not in addresses or cols[2].rsplit(":", 1)[1] in spared:
                continue
            try:
                with socket.socket(fileno=os.dup(sockets[cols[9]])) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:
                continue
    return shut


class Unblocker(BackgroundLoop):
    """A daemon thread beside a rank's ``LiveGroup``: ``generation()`` says the generation the rank is in and
    whether it already asked the agent (then nothing is done); ``keys``: the rank's connection to the agent's store
    (a TCPStore client runs one operation at a time: shared, it costs the store no connection more; each one more
    made at a rank's start was answered 5 s late from 16 ranks)."""

    def __init__(self, keys: LiveStore, agent_port: int, rank: int,
                 generation: Callable[[], tuple[int, bool]]) -> None:
        super().__init__(f"ddpkit-live-unblock-{rank}")
        self.keys, self.agent_port, self.rank, self.generation = keys, agent_port, rank, generation

    def loop(self) -> None:
        import torch.distributed as dist

        keys = self.keys
        seen: tuple[int, float] | None = None
        while not self.stopping.wait(LOOK_S):
            gen, asked = self.generation()
            try:
                plan = keys.plan(gen + 1)
            except (RuntimeError, dist.DistError):
                return
            if plan is None or asked:
                seen = None
                continue
            if seen is None or seen[0] != gen:
                seen = (gen, time.monotonic())
            elif time.monotonic() - seen[1] >= UNBLOCK_AFTER_S:
                self._free(plan)
                seen = (gen, float("inf"))  # once a generation

    def _free(self, plan: Plan) -> None:
        here = socket.gethostname().split(".", 1)[0]
        addresses = {a for a in addresses_of(h for h in plan.hosts if h != here)
                     if not ipaddress.ip_address(a).is_loopback}  # a rank of this host: its kernel closed its sockets
        shut = shut_connections_to(addresses, spare_ports=(self.agent_port, plan.port)) if addresses else 0
        log.warning("rank %d: still in generation %d %.1f s after the agent found rank(s) %s on %s lost (%s): %s",
                    self.rank, plan.gen - 1, UNBLOCK_AFTER_S, ", ".join(map(str, plan.ranks)),
                    ", ".join(sorted(set(plan.hosts))), plan.why,
                    f"shut its {shut} connection(s) to {', '.join(sorted(addresses))}, so its collective fails"
                    if shut else "no connection to them found to shut (its collective waits on a peer still in it, "
                    "or for its timeout)")
