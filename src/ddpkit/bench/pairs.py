"""Slow-link finder: point-to-point bandwidth and latency between every pair of nodes (or ranks).

Pairs run one at a time while every other rank waits at a barrier, so a pair never shares a link with
another measurement. In node mode the first rank of each node stands for its node. Each pair measures
latency as half the round trip of a one-element ping-pong, and bandwidth as ``size / time`` for sending
``size`` bytes and receiving a one-element acknowledgement, the median over the iterations.

Judging: the reference bandwidth is the median over endpoints of each endpoint's *best* link (what a healthy
endpoint reaches). A link is slow when its bandwidth is below ``threshold`` x reference (or its latency
above reference latency / threshold); an endpoint is slow when even its best link is. With three ranks and
one bad rank, two of three links are bad, so a plain median of links would hide it; the best-link median does not.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpkit.fault_injection import fault
from ddpkit.log import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["PairsResult", "judge", "measure_pairs"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class PairsResult:
    """The matrices and the verdict, identical on every rank."""

    mode: str
    """``nodes`` or ``ranks``: what the endpoints are."""
    names: tuple[str, ...]
    """Endpoint labels: host names (nodes) or ``rank N (host)``."""
    leaders: tuple[int, ...]
    """Global rank that measured for each endpoint."""
    bandwidth: tuple[tuple[float, ...], ...]
    """GB/s between endpoints i and j (symmetric; 0 on the diagonal)."""
    latency_us: tuple[tuple[float, ...], ...]
    """One-way latency in microseconds between endpoints i and j."""
    size: int
    """Bytes sent per bandwidth measurement."""
    threshold: float
    """Fraction of the reference bandwidth below which a link is named."""
    reference_bw: float
    """Median over endpoints of their best link's bandwidth, GB/s."""
    reference_latency_us: float
    """Median over endpoints of their best link's latency, us."""
    slow_links: tuple[tuple[int, int], ...]
    """Endpoint index pairs judged slow."""
    slow_endpoints: tuple[int, ...]
    """Endpoints whose best link is slow."""
    note: str | None = None
    """Why the mode differs from the one asked for, if it does."""

    def as_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "names": list(self.names), "leaders": list(self.leaders),
            "bandwidth_gbps": [list(r) for r in self.bandwidth], "latency_us": [list(r) for r in self.latency_us],
            "size": self.size, "threshold": self.threshold, "reference_bw": self.reference_bw,
            "reference_latency_us": self.reference_latency_us,
            "slow_links": [[self.names[a], self.names[b]] for a, b in self.slow_links],
            "slow_endpoints": [self.names[i] for i in self.slow_endpoints], "note": self.note,
        }


def judge(bandwidth: list[list[float]], latency: list[list[float]], threshold: float
          ) -> tuple[float, float, list[tuple[int, int]], list[int]]:
    """Pure verdict over symmetric matrices: (reference bw, reference latency, slow links, slow endpoints)."""
    n = len(bandwidth)
    if n < 2:
        return 0.0, 0.0, [], []
    best_bw = [max(bandwidth[i][j] for j in range(n) if j != i) for i in range(n)]
    best_lat = [min(latency[i][j] for j in range(n) if j != i) for i in range(n)]
    ref_bw, ref_lat = statistics.median(best_bw), statistics.median(best_lat)
    links = [(i, j) for i in range(n) for j in range(i + 1, n)
             if bandwidth[i][j] < threshold * ref_bw or latency[i][j] > ref_lat / threshold]
    endpoints = [i for i in range(n) if best_bw[i] < threshold * ref_bw or best_lat[i] > ref_lat / threshold]
    return ref_bw, ref_lat, links, endpoints


def _slow_down(rank: int) -> None:
    """Test hook ``slow:rank=R:ms=M``: this rank stalls M ms before each point-to-point send."""
    armed = fault("slow", rank=rank)
    if armed is not None:
        time.sleep(float(armed.get("ms", "20")) / 1e3)


def _pingpong(me: int, peer: int, leader: bool, payload: torch.Tensor, ack: torch.Tensor, iters: int) -> float:
    """Median seconds of one exchange: the leader sends ``payload`` and waits for ``ack``; the peer mirrors."""
    import torch.distributed as dist

    times = []
    for _ in range(iters + 1):  # the first exchange warms the connection up and is dropped
        t0 = time.perf_counter()
        if leader:
            _slow_down(me)
            dist.send(payload, peer)
            dist.recv(ack, peer)
        else:
            dist.recv(payload, peer)
            _slow_down(me)
            dist.send(ack, peer)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _endpoints(mode: str, rank: int, world_size: int) -> tuple[str, list[str], list[int], str | None]:
    import torch.distributed as dist

    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    note = None
    if mode == "nodes" and len(set(hosts)) < 2:
        note = f"all {world_size} ranks are on one node ({hosts[0]}): measuring between ranks instead"
        mode = "ranks"
    if mode == "ranks":
        return mode, [f"rank {r} ({h})" for r, h in enumerate(hosts)], list(range(world_size)), note
    leaders: dict[str, int] = {}
    for r, h in enumerate(hosts):
        leaders.setdefault(h, r)
    return mode, list(leaders), list(leaders.values()), note


def measure_pairs(*, mode: str, size: int, iters: int, threshold: float, rank: int, world_size: int,
                  device: torch.device) -> PairsResult:
    """Measure every pair of endpoints, one pair at a time; collective: every rank must call it."""
    import torch
    import torch.distributed as dist

    mode, names, leaders, note = _endpoints(mode, rank, world_size)
    n = len(leaders)
    bw = torch.zeros(n, n, dtype=torch.float64)
    lat = torch.zeros(n, n, dtype=torch.float64)
    payload = torch.empty(max(size // 4, 1), dtype=torch.float32, device=device).fill_(1.0)
    ack = torch.zeros(1, dtype=torch.float32, device=device)
    for i in range(n):
        for j in range(i + 1, n):
            a, b = leaders[i], leaders[j]
            if rank in (a, b):
                peer = b if rank == a else a
                small = _pingpong(rank, peer, rank == a, ack.clone(), ack, iters) / 2
                big = _pingpong(rank, peer, rank == a, payload, ack, iters)
                if rank == a:
                    lat[i, j] = lat[j, i] = small * 1e6
                    bw[i, j] = bw[j, i] = payload.numel() * payload.element_size() / big / 1e9 if big > 0 else 0.0
            dist.barrier()
    both = torch.stack([bw, lat]).to(device)
    dist.all_reduce(both)  # each entry was written by exactly one rank
    bw_rows = both[0].cpu().tolist()
    lat_rows = both[1].cpu().tolist()
    ref_bw, ref_lat, links, slow = judge(bw_rows, lat_rows, threshold)
    return PairsResult(mode=mode, names=tuple(names), leaders=tuple(leaders),
                       bandwidth=tuple(tuple(r) for r in bw_rows), latency_us=tuple(tuple(r) for r in lat_rows),
                       size=payload.numel() * payload.element_size(), threshold=threshold, reference_bw=ref_bw,
                       reference_latency_us=ref_lat, slow_links=tuple(links), slow_endpoints=tuple(slow), note=note)
