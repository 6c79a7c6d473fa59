"""Who joined a c10d rendezvous, so one that never completes can say which hosts came and which ranks have none.

torch's agent reports only "timed out" when a node never arrives. While the agent waits, ddpkit reads the
rendezvous state from the same store (a client connection, once a second) and keeps the last list of nodes.
"""

from __future__ import annotations

import base64
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta

from ddpkit.base.background import BackgroundLoop
from ddpkit.base.log import get_logger
from ddpkit.base.shape import DEFAULT_RDZV_PORT, JobShape, split_endpoint

__all__ = ["JoinedNode", "RendezvousWatch", "describe_missing"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class JoinedNode:
    """An agent seen in the rendezvous."""

    addr: str
    """The address it registered (its --local-addr, or its hostname)."""
    pid: int
    """Its agent's process id."""

    def name(self) -> str:
        """``hostname (address)`` where the address maps back to a name, else the address."""
        from ddpkit.base.netinfo import is_local_address, resolve

        try:
            ip = resolve(self.addr)
            host = socket.gethostname() if is_local_address(ip) else socket.gethostbyaddr(ip)[0]
        except OSError:
            return self.addr
        return self.addr if host == self.addr else f"{host} ({self.addr})"


class RendezvousWatch(BackgroundLoop):
    """Polls the c10d rendezvous state at ``endpoint`` for ``run_id`` in a daemon thread until stopped or the
    round completes; :attr:`nodes` holds every agent seen in it (participants and waiting)."""

    def __init__(self, endpoint: str, run_id: str, interval: float = 1.0) -> None:
        self._host, port = split_endpoint(endpoint)
        self._port = port or DEFAULT_RDZV_PORT
        self._key = f"torch.rendezvous.{run_id}"
        self._interval = interval
        super().__init__("ddpkit-rdzv-watch")
        self.nodes: tuple[JoinedNode, ...] = ()
        self.completed = False
        """The round was seen complete: a later rendezvous error is a lost store, not a join timeout."""

    def loop(self) -> None:
        import torch.distributed as dist

        store = None
        while not self.stopping.wait(self._interval):
            try:
                if store is None:
                    store = dist.TCPStore(self._host, self._port, is_master=False, timeout=timedelta(seconds=2),
                                          wait_for_workers=False)
                if not store.check([self._key]):
                    continue
                state = pickle.loads(base64.b64decode(store.get(self._key)))  # what torch's agents wrote
            except Exception:  # not up yet, or gone: keep the last view
                store = None
                continue
            seen = [*getattr(state, "participants", {}), *getattr(state, "wait_list", ())]
            # every node seen so far: a timed-out node leaves the state just before its agent gives up
            found = {JoinedNode(addr=str(n.addr), pid=int(n.pid)) for n in seen} | set(self.nodes)
            self.nodes = tuple(sorted(found, key=lambda n: (n.addr, n.pid)))
            if getattr(state, "complete", False):
                self.completed = True
                return


def describe_missing(nodes: tuple[JoinedNode, ...], shape: JobShape, complete: bool = False) -> str:
    """One sentence: who joined and which ranks are left without a host. Consistent with itself: when every
    node was seen but the round never completed, it says that a node left again instead of "N of N joined"."""
    joined = len(nodes)
    names = ", ".join(n.name() for n in nodes) or "none"
    min_nodes, nproc = shape.min_nodes, shape.nproc_per_node
    wanted = shape.nodes_text(" to ")
    if complete:
        return f"the round had completed with {joined} node(s): {names}"
    if joined >= min_nodes:
        return (f"{joined} node(s) were seen ({names}), {wanted} wanted, yet the round never completed: a node "
                "left again before it did, or the agents could not reach the store in time")
    text = f"{joined} of {wanted} node(s) joined: {names}"
    if joined < min_nodes:
        first, last = joined * nproc, min_nodes * nproc - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        text += f"; {min_nodes - joined} node(s) never arrived: {ranks} of {min_nodes * nproc} have no host"
    return text
