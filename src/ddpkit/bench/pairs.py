"""Slow-link finder: point-to-point bandwidth and latency between pairs of nodes (or ranks), measured in rounds.

Which pairs are measured when, and how the figures are judged, is ``bench/schedules.py`` (pure logic); this module
measures them and reports.

Each pair measures latency as half the fastest of ``iters`` (at least 10) round trips of a one-element ping-pong
(queueing and a busy CPU only ever add time to a round trip this small, so the fastest is the link's), and
bandwidth as ``size / time`` for sending ``size`` bytes and receiving a one-element acknowledgement, the median over
the iterations.

A pair measures for a bounded time, as iperf does (``seconds``, ``--pairs-seconds``): its transfers grow from
64 KiB, 4x each, up to ``size``, then ``iters`` transfers of ``size``; the pair stops early when its next transfer
would end past the budget at the rate of the last one. A healthy link moves ``iters`` whole transfers within the
budget; a slow one is measured on the largest transfer it moved in time (the pair is listed as cut short). So a
round lasts at most about one budget even when a slow endpoint plays in every round, which is what makes rounds
and ``--ring`` cheaper than one pair at a time on a fabric with a slow node: with transfers of a fixed size, a
k times slower link would make each of its rounds k times longer.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.base.fault_injection import fault
from ddpkit.base.log import get_logger
from ddpkit.bench import schedules
from ddpkit.bench.schedules import Link, Pair

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SECONDS", "SCHEDULES", "PairsResult", "format_pairs", "measure_pairs"]

log = get_logger(__name__)
SCHEDULES = ("rounds", "ring", "sequential")
REFERENCES = 2  # healthy endpoints measured against the suspects in --ring mode
# round trips a latency is the fastest of, at least: a busy CPU delays some (the pairs of a round start together)
LATENCY_SAMPLES = 10
CONFIRM_LATENCY_SAMPLES = 50  # a confirmation measures one or few pairs: more round trips cost little there
CONFIRM_PASSES = 3  # re-measurements of a link a verdict rests on, at most (``schedules.confirm``)
DEFAULT_SECONDS = 1.0  # a pair's time budget (iperf measures for a fixed time too: its -t)


@dataclass(frozen=True, kw_only=True)
class PairsResult:
    """The measurements and the verdict, identical on every rank."""

    mode: str
    """``nodes`` or ``ranks``: what the endpoints are."""
    schedule: str
    """``rounds``, ``ring`` or ``sequential``."""
    names: tuple[str, ...]
    """Endpoint labels: host names (nodes) or ``rank N (host)``."""
    leaders: tuple[int, ...]
    """Global rank that measured for each endpoint."""
    links: Mapping[Pair, Link]
    """(bandwidth GB/s, one-way latency us) of every measured pair (i < j)."""
    rounds: tuple[dict[str, Any], ...]
    """Per round: its pairs, wall seconds, median bandwidth, the pairs slow within the round."""
    size: int
    """Bytes sent per bandwidth measurement."""
    threshold: float
    """Fraction of the reference bandwidth below which a link is named."""
    reference_bw: float
    """Median over endpoints of their best link's bandwidth, GB/s."""
    reference_latency_us: float
    """Median over endpoints of their best link's latency, us."""
    slow_links: tuple[Pair, ...]
    """Endpoint index pairs judged slow (overall and within their round)."""
    slow_endpoints: tuple[int, ...]
    """Endpoints whose best link is slow."""
    suspects: tuple[int, ...] = ()
    """``ring``: endpoints of a slow ring link, measured against each other and the references."""
    seconds: float = 0.0
    """Wall time of every round, barriers included."""
    note: str | None = None
    """Why the mode differs from the one asked for, if it does."""
    budget_s: float = DEFAULT_SECONDS
    """Each pair's time budget, seconds."""
    cut: tuple[Pair, ...] = ()
    """Pairs whose budget ran out before ``iters`` whole transfers: measured on what they moved by then."""

    def matrix(self, index: int) -> list[list[float | None]]:
        """Bandwidth (0) or latency (1) as a symmetric matrix; None where not measured, 0 on the diagonal."""
        n = len(self.names)
        m: list[list[float | None]] = [[0.0 if i == j else None for j in range(n)] for i in range(n)]
        for (a, b), link in self.links.items():
            m[a][b] = m[b][a] = link[index]
        return m

    def as_dict(self) -> dict[str, object]:
        n = len(self.names)
        return {
            "mode": self.mode, "schedule": self.schedule, "names": list(self.names), "leaders": list(self.leaders),
            "bandwidth_gbps": self.matrix(0), "latency_us": self.matrix(1),
            "size": self.size, "threshold": self.threshold, "reference_bw": self.reference_bw,
            "reference_latency_us": self.reference_latency_us,
            "slow_links": [[self.names[a], self.names[b]] for a, b in self.slow_links],
            "slow_endpoints": [self.names[i] for i in self.slow_endpoints],
            "suspects": [self.names[i] for i in self.suspects],
            "rounds": [{**r, "pairs": [[self.names[a], self.names[b]] for a, b in r["pairs"]],
                        "slow": [[self.names[a], self.names[b]] for a, b in r["slow"]]} for r in self.rounds],
            "cost": {"rounds": len(self.rounds), "pairs_measured": len(self.links), "seconds": self.seconds,
                     "would_take_rounds": schedules.schedule_cost(n)},
            "note": self.note, "budget_s": self.budget_s,
            "cut_short": [[self.names[a], self.names[b]] for a, b in self.cut],
        }


def _stall(rank: int, peer: int, measure: int) -> float:
    """Test hook ``slow:rank=R[:peer=P]:ms=M[:measures=K]``: seconds this rank stalls before each point-to-point
    send of its ``measure``-th (1-based) measurement with ``peer``; ``measures`` limits the stall to the first K
    (a transient stall), ``peer`` to one link (a bad cable)."""
    armed = fault("slow", rank=rank, peer=peer)
    if armed is None or measure > int(armed.get("measures", "0") or 0) > 0:
        return 0.0
    return float(armed.get("ms", "20")) / 1e3


RAMP = 64 << 10  # bytes: a pair's first transfer; each next one 4x larger, up to --pairs-size


def _pingpong(peer: int, leader: bool, ping: torch.Tensor, ack: torch.Tensor, iters: int, stall: float) -> float:
    """Seconds of the fastest of ``iters`` one-element round trips (after one to warm the connection up): the
    leader sends ``ping`` and waits for ``ack``; the peer mirrors."""
    import torch.distributed as dist

    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        if leader:
            if stall:
                time.sleep(stall)
            dist.send(ping, peer)
            dist.recv(ack, peer)
        else:
            dist.recv(ping, peer)
            if stall:
                time.sleep(stall)
            dist.send(ack, peer)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _exchanges(peer: int, leader: bool, buf: torch.Tensor, ack: torch.Tensor, header: torch.Tensor, iters: int,
               deadline: float, stall: float) -> list[tuple[int, float]]:
    """Exchanges of growing size on one pair: the leader sends ``RAMP`` bytes of ``buf``, then 4x more each time
    up to all of it, then ``iters`` more of all of it (the first exchange is always a warm-up), the peer answering
    each with ``ack``. Before each, the leader sends a one-element ``header`` with its element count (0: done),
    chosen then: when the next exchange would end past ``deadline`` (``time.perf_counter()``) at the rate of the
    last one, the pair stops there, so a slow link is measured on the largest transfer it moved in time instead
    of holding the whole round up. Returns the leader's (bytes, seconds of data and ack) per exchange; ``[]`` on
    the peer."""
    import torch.distributed as dist

    if not leader:
        while True:
            dist.recv(header, peer)
            n = int(header.item())
            if n <= 0:
                return []
            dist.recv(buf[:n], peer)
            if stall:
                time.sleep(stall)
            dist.send(ack, peer)
    numel, size = buf.numel(), buf.numel() * buf.element_size()
    n = min(numel, max(RAMP // buf.element_size(), 1))
    full_left = iters + (1 if n == numel else 0)
    out: list[tuple[int, float]] = []
    while full_left > 0:
        if out and time.perf_counter() + n * buf.element_size() * out[-1][1] / out[-1][0] > deadline:
            break
        header.fill_(n)
        dist.send(header, peer)
        if stall:
            time.sleep(stall)
        t0 = time.perf_counter()
        dist.send(buf[:n], peer)
        dist.recv(ack, peer)
        out.append((n * buf.element_size(), time.perf_counter() - t0))
        full_left -= out[-1][0] == size
        n = min(numel, n * 4)
    header.fill_(0)
    dist.send(header, peer)
    return out


def _figure(exchanges: Sequence[tuple[int, float]], size: int, iters: int) -> tuple[float, bool]:
    """(bytes per second, cut short) from one pair's exchanges: the median over the exchanges of the largest size
    it reached, the pair's very first exchange (the warm-up) left out unless it is alone; cut short when that size
    is below ``size`` or fewer than ``iters`` of them were measured."""
    largest = max(n for n, _ in exchanges)
    kept = [n / s for k, (n, s) in enumerate(exchanges) if n == largest and (k > 0 or len(exchanges) == 1) and s > 0]
    return (statistics.median(kept) if kept else 0.0), largest < size or len(kept) < iters


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


class _Rounds:
    """Runs rounds of pairs on every rank; each pair's lower endpoint's leader keeps the figures."""

    def __init__(self, leaders: Sequence[int], rank: int, size: int, iters: int, seconds: float,
                 device: torch.device) -> None:
        import torch

        self.leaders, self.rank, self.iters, self.budget = list(leaders), rank, iters, seconds
        self.round_trips = max(iters, LATENCY_SAMPLES)
        self.measures: dict[int, int] = {}  # measurements of each peer so far
        self.payload = torch.empty(max(size // 4, 1), dtype=torch.float32, device=device).fill_(1.0)
        self.ping = torch.zeros(1, dtype=torch.float32, device=device)
        self.ack = torch.zeros(1, dtype=torch.float32, device=device)
        self.header = torch.zeros(1, dtype=torch.float64, device=device)  # element counts, exact up to 2**53
        self.size = self.payload.numel() * self.payload.element_size()
        self.mine: dict[Pair, Link] = {}
        self.cut: set[Pair] = set()
        self.seconds: list[float] = []

    def _pair(self, peer: int, leader: bool) -> tuple[Link, bool]:
        """One pair's (bandwidth GB/s, one-way latency us) and whether the budget cut it short (meaningful on the
        leader)."""
        deadline = time.perf_counter() + self.budget  # the round trips take little; the budget is for the bytes
        self.measures[peer] = self.measures.get(peer, 0) + 1
        stall = _stall(self.rank, peer, self.measures[peer])
        latency = _pingpong(peer, leader, self.ping, self.ack, self.round_trips, stall) / 2
        big = _exchanges(peer, leader, self.payload, self.ack, self.header, self.iters, deadline, stall)
        if not leader:
            return (0.0, 0.0), False
        bandwidth, cut = _figure(big, self.size, self.iters)
        return (bandwidth / 1e9, latency * 1e6), cut

    def run(self, rounds: Sequence[Sequence[Pair]]) -> dict[Pair, Link]:
        """Measure ``rounds`` (collective: every rank calls it); every rank gets every pair's figures."""
        import torch.distributed as dist

        for pairs in rounds:
            t0 = time.perf_counter()
            for i, j in pairs:
                a, b = self.leaders[i], self.leaders[j]
                if self.rank in (a, b):
                    link, cut = self._pair(b if self.rank == a else a, self.rank == a)
                    if self.rank == a:
                        self.mine[(i, j)] = link
                        (self.cut.add if cut else self.cut.discard)((i, j))  # a re-measured pair: its latest
            dist.barrier()
            self.seconds.append(time.perf_counter() - t0)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.mine, self.cut))
        self.cut = {p for _, cut in everyone for p in cut}
        return {p: link for part, _ in everyone for p, link in part.items()}


def _suspects(n: int, plan: Sequence[Sequence[Pair]], ring: Mapping[Pair, Link], threshold: float
              ) -> tuple[list[int], list[int]]:
    """From the ring pass: the suspects among the endpoints of slow ring links (slow overall and within their
    round; ``ring_suspects``), and up to REFERENCES healthy endpoints (the fastest)."""
    _, _, overall, _ = schedules.judge_links(n, ring, threshold)
    suspects = schedules.ring_suspects(schedules.named_links(plan, ring, overall, threshold))
    if not suspects:
        return [], []
    best = {e: max(bw for p, (bw, _) in ring.items() if e in p) for e in range(n) if e not in suspects}
    return suspects, sorted(sorted(best, key=lambda e: -best[e])[:REFERENCES])


def measure_pairs(*, mode: str, size: int, iters: int, threshold: float, rank: int, world_size: int,
                  device: torch.device, schedule: str = "rounds", seconds: float = DEFAULT_SECONDS) -> PairsResult:
    """Measure pairs of endpoints on ``schedule`` and judge them; collective: every rank must call it. A pair
    measures for about ``seconds`` at most, counted from its start: its round trips (at least 10, one element each)
    always complete; its transfers stop when the next would end past that."""
    mode, names, leaders, note = _endpoints(mode, rank, world_size)
    n = len(leaders)
    runner = _Rounds(leaders, rank, size, iters, seconds, device)
    suspects: list[int] = []
    if schedule == "sequential":
        plan = [[(i, j)] for i in range(n) for j in range(i + 1, n)]
        links = runner.run(plan)
    elif schedule == "ring":
        plan = schedules.ring_rounds(n)
        links = runner.run(plan)
        suspects, references = _suspects(n, plan, links, threshold)
        chosen = suspects + references
        second = [sorted((min(chosen[a], chosen[b]), max(chosen[a], chosen[b])) for a, b in r)
                  for r in schedules.round_robin(len(chosen))] if suspects else []
        links.update(runner.run(second))
        plan = plan + second
    else:
        plan = schedules.round_robin(n)
        links = runner.run(plan)
    runner.round_trips = max(iters, CONFIRM_LATENCY_SAMPLES)
    again = schedules.confirm(n, plan, links, threshold, runner.run, CONFIRM_PASSES)
    ref_bw, ref_lat, overall, slow = schedules.judge_links(n, links, threshold)
    named = schedules.named_links(plan, links, overall, threshold)
    rounds = []
    for k, (pairs, took) in enumerate(zip(plan + again, runner.seconds, strict=True)):
        median, in_round = schedules.judge_round(pairs, links, threshold)
        rounds.append({"pairs": list(pairs), "seconds": round(took, 4), "median_bw": median, "slow": in_round,
                       "confirm": k >= len(plan)})
    return PairsResult(mode=mode, schedule=schedule, names=tuple(names), leaders=tuple(leaders), links=links,
                       rounds=tuple(rounds), size=runner.size, threshold=threshold, reference_bw=ref_bw,
                       reference_latency_us=ref_lat, slow_links=tuple(named),
                       slow_endpoints=tuple(slow), suspects=tuple(suspects), seconds=sum(runner.seconds), note=note,
                       budget_s=seconds, cut=tuple(sorted(runner.cut)))


def _cell(value: float | None, fmt: str) -> str:
    return "." if value is None else fmt.format(value)


def format_pairs(p: Mapping[str, Any], max_matrix: int = 16) -> str:
    """The human report of ``PairsResult.as_dict()``: matrices (up to ``max_matrix`` endpoints), rounds, cost,
    verdict."""
    from ddpkit.bench.sizes import format_size

    names, bw, lat = p["names"], p["bandwidth_gbps"], p["latency_us"]
    n, cost = len(names), p["cost"]
    lines = [f"# point-to-point between {p['mode']}, schedule {p['schedule']} ({format_size(p['size'])} per transfer; "
             "latency one-way; '.' not measured)"]
    if p.get("note"):
        lines.append(f"# note: {p['note']}")
    if n <= max_matrix:
        width = max(10, *(len(x) for x in names)) + 1
        for title, matrix, fmt in (("bandwidth (GB/s)", bw, "{:.3f}"), ("latency (us)", lat, "{:.1f}")):
            lines.append(f"# {title}")
            lines.append(" " * width + "".join(f"{x:>{width}}" for x in names))
            for i, name in enumerate(names):
                cells = "".join(f"{'-' if i == j else _cell(matrix[i][j], fmt):>{width}}" for j in range(n))
                lines.append(f"{name:<{width}}{cells}")
    else:
        lines.append(f"# {n} endpoints: matrices in the JSON report (--json)")
    for k, r in enumerate(p["rounds"]):
        if k < 20 or r["slow"]:
            slow = ", ".join(f"{a} <-> {b}" for a, b in r["slow"]) or "none"
            what = "confirmation, " if r.get("confirm") else ""
            lines.append(f"# round {k + 1:>3}: {what}{len(r['pairs'])} pair(s) at once, median "
                         f"{r['median_bw']:.3f} GB/s, {r['seconds']:.2f} s; slow within the round: {slow}")
    if p["schedule"] == "ring":
        lines.append("# ring suspects: " + (", ".join(p["suspects"]) or "none (no slow ring link)"))
    if p.get("cut_short"):
        lines.append(f"# {len(p['cut_short'])} pair(s) ran out of their {p['budget_s']:g} s budget before "
                     "--pairs-iters whole transfers and were measured on what they moved by then: "
                     + ", ".join(f"{a} <-> {b}" for a, b in p["cut_short"][:8])
                     + (", ..." if len(p["cut_short"]) > 8 else ""))
    would = cost["would_take_rounds"]
    lines.append(f"# cost: {cost['rounds']} round(s), {cost['pairs_measured']} pair(s) measured, "
                 f"{cost['seconds']:.2f} s; for {n} endpoints every pair takes {would['rounds']} rounds "
                 f"(--pairs), {would['sequential']} one pair at a time; the ring pass {would['ring']} "
                 "round(s) plus the suspects' rounds (--ring)")
    lines.append(f"# reference (median of each endpoint's best link): {p['reference_bw']:.3f} GB/s, "
                 f"{p['reference_latency_us']:.1f} us; slow = below {p['threshold']:.0%} of it "
                 f"(or latency above {1 / p['threshold']:.1f}x), overall and within its round")
    links = [f"{a} <-> {b}" for a, b in p["slow_links"]]
    lines.append("# slow links: " + (", ".join(links) if links else "none"))
    lines.append("# slow " + p["mode"] + ": " + (", ".join(p["slow_endpoints"]) or "none"))
    return "\n".join(lines) + "\n"
