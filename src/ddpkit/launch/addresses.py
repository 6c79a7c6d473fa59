"""Which address this node gives the others, and whether it hosts the c10d rendezvous store."""

from __future__ import annotations

import socket

from ddpkit.base.log import get_logger
from ddpkit.base.shape import DEFAULT_RDZV_PORT, split_endpoint

__all__ = ["hosts_endpoint", "local_addr_towards"]

log = get_logger(__name__)


def local_addr_towards(endpoint: str) -> str | None:
    """This node's address on the interface that routes to the rendezvous host: the address the other nodes
    (and this node's workers, as MASTER_ADDR when it is node 0) use for it. None (torch's default, the
    hostname) where no route is found or the endpoint is loopback."""
    from ddpkit.base.netinfo import route_to

    host, _ = split_endpoint(endpoint)
    try:
        ifname, local_ip = route_to(host)
    except OSError as exc:
        log.warning("no route to the rendezvous host %s (%s): the other nodes will be told this host's name, %s",
                    host, exc, socket.gethostname())
        return None
    if ifname == "lo":
        return None
    log.info("local address %s (on %s): it routes to the rendezvous host %s", local_ip, ifname, host)
    return local_ip


def hosts_endpoint(endpoint: str) -> bool:
    """True when the c10d rendezvous endpoint is one of this host's own addresses, so this agent must host the
    rendezvous store. torch decides that from the hostname's addresses only, which miss the interface addresses
    where the hostname resolves to 127.0.1.1: then no agent hosts the store and every agent times out."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    from ddpkit.base.netinfo import is_local_address, resolve

    host, port = split_endpoint(endpoint)
    try:
        address = resolve(host)
    except OSError:
        return False
    if _matches_machine_hostname(host) or not is_local_address(address):
        return False  # torch finds it by itself (loopback, the hostname), or another host serves it
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no owner
        try:
            s.bind((address, port or DEFAULT_RDZV_PORT))
        except OSError:  # another agent on this host serves it already
            return False
    log.warning("hosting the rendezvous store: %s is this host's own address (is_host=true; pass "
                "--rdzv-conf is_host=false to leave it to another process)", host)
    return True
