"""Slow-link finder: point-to-point bandwidth and latency between pairs of nodes (or ranks), measured in rounds.

Schedules (the cost of each, in rounds, is printed with the result; a round takes about one pair's time):

- ``rounds`` (default): every pair, as a round-robin tournament (the circle method): N-1 rounds for N endpoints
  (N for odd N, one endpoint sits out each round), each round a perfect matching whose pairs are measured at the
  same time. On a non-blocking fabric the pairs of a round share no link, so they do not disturb each other.
- ``ring``: a quick pass, every endpoint against its two ring neighbours (2 rounds; 3 for odd N), which names the
  suspects (endpoints of a slow ring link); then every pair among the suspects and a few healthy references, in
  rounds. Cost 2 + (S+R-1) rounds for S suspects and R references, whatever N is.
- ``sequential``: one pair at a time, every other rank waiting at a barrier: N(N-1)/2 rounds (the old way; kept
  as the baseline the benchmark compares with).

Each pair measures latency as half the fastest round trip of a one-element ping-pong (queueing and a busy CPU
only ever add time to a round trip this small, so the fastest is the link's), and bandwidth as ``size / time``
for sending ``size`` bytes and receiving a one-element acknowledgement, the median over the iterations.

Judging, overall: the reference bandwidth is the median over endpoints of each endpoint's *best* measured link
(what a healthy endpoint reaches). A link is slow when its bandwidth is below ``threshold`` x reference (or its
latency above reference latency / threshold); an endpoint is slow when even its best link is. With three
endpoints and one bad one, two of three links are bad, so a plain median of links would hide it; the best-link
median does not. Within each round: a link is also compared with the median of its own round, measured at the
same moment, so a round in which the whole (shared) machine slowed down does not name links; a link is named
slow only when it is slow both overall and within its round (rounds of one pair: overall alone). A slow link
between two endpoints that are not slow themselves, and the best link of every slow endpoint, are measured once
more (``confirm`` rounds, a matching of those links) and keep their better figure: a transient stall is not a
bad cable.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.fault_injection import fault
from ddpkit.log import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["SCHEDULES", "PairsResult", "format_pairs", "judge", "judge_links", "measure_pairs", "ring_rounds",
           "round_robin", "schedule_cost"]

log = get_logger(__name__)
SCHEDULES = ("rounds", "ring", "sequential")
REFERENCES = 2  # healthy endpoints measured against the suspects in --ring mode
Pair = tuple[int, int]
Link = tuple[float, float]  # bandwidth GB/s, one-way latency us


def round_robin(n: int) -> list[list[Pair]]:
    """The circle method: endpoint 0 stays, the others rotate one seat per round; ``n - 1`` rounds for even ``n``,
    ``n`` for odd ``n`` (a phantom endpoint gives one real endpoint a bye each round). Every round is a perfect
    matching of the endpoints playing, and every pair meets exactly once."""
    if n < 2:
        return []
    m = n + n % 2
    seats = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [(seats[k], seats[m - 1 - k]) for k in range(m // 2)]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs if a < n and b < n))
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return rounds


def ring_rounds(n: int) -> list[list[Pair]]:
    """Every endpoint against its ring neighbours: even links, then odd links (then the closing link for odd n)."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    even = [(i, i + 1) for i in range(0, n - 1, 2)]
    odd = [(i, i + 1) for i in range(1, n - 1, 2)]
    closing = [(0, n - 1)]
    return [even, odd + closing] if n % 2 == 0 else [even, odd, closing]


def schedule_cost(n: int) -> dict[str, int]:
    """Rounds each schedule takes for ``n`` endpoints (ring: its first pass; the suspects' rounds come on top)."""
    return {"sequential": n * (n - 1) // 2, "rounds": len(round_robin(n)), "ring": len(ring_rounds(n))}


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
                     "would_take_rounds": schedule_cost(n)},
            "note": self.note,
        }


def judge_links(n: int, links: Mapping[Pair, Link], threshold: float
                ) -> tuple[float, float, list[Pair], list[int]]:
    """Verdict over the measured links: (reference bw, reference latency, slow links, slow endpoints)."""
    best_bw: dict[int, float] = {}
    best_lat: dict[int, float] = {}
    for (a, b), (bw, lat) in links.items():
        for e in (a, b):
            best_bw[e] = max(best_bw.get(e, 0.0), bw)
            best_lat[e] = min(best_lat.get(e, float("inf")), lat)
    if n < 2 or not links:
        return 0.0, 0.0, [], []
    ref_bw, ref_lat = statistics.median(best_bw.values()), statistics.median(best_lat.values())
    slow = sorted(p for p, (bw, lat) in links.items() if bw < threshold * ref_bw or lat > ref_lat / threshold)
    endpoints = sorted(e for e in best_bw if best_bw[e] < threshold * ref_bw or best_lat[e] > ref_lat / threshold)
    return ref_bw, ref_lat, slow, endpoints


def judge(bandwidth: list[list[float]], latency: list[list[float]], threshold: float
          ) -> tuple[float, float, list[Pair], list[int]]:
    """Pure verdict over full symmetric matrices (every pair measured)."""
    n = len(bandwidth)
    links = {(i, j): (bandwidth[i][j], latency[i][j]) for i in range(n) for j in range(i + 1, n)}
    return judge_links(n, links, threshold)


def judge_round(pairs: Sequence[Pair], links: Mapping[Pair, Link], threshold: float) -> tuple[float, list[Pair]]:
    """A round against itself: (median bandwidth of its pairs, the pairs below ``threshold`` x that median or
    above its median latency / ``threshold``)."""
    measured = [p for p in pairs if p in links]
    if len(measured) < 2:
        return (links[measured[0]][0] if measured else 0.0), []
    bw = statistics.median(links[p][0] for p in measured)
    lat = statistics.median(links[p][1] for p in measured)
    return bw, [p for p in measured if links[p][0] < threshold * bw or links[p][1] > lat / threshold]


def matchings(links: Sequence[Pair]) -> list[list[Pair]]:
    """Greedy rounds for a few links: each link goes to the first round where neither endpoint plays yet."""
    rounds: list[list[Pair]] = []
    for a, b in links:
        for r in rounds:
            if all(a not in p and b not in p for p in r):
                r.append((a, b))
                break
        else:
            rounds.append([(a, b)])
    return rounds


def _slow_down(rank: int) -> None:
    """Test hook ``slow:rank=R:ms=M``: this rank stalls M ms before each point-to-point send."""
    armed = fault("slow", rank=rank)
    if armed is not None:
        time.sleep(float(armed.get("ms", "20")) / 1e3)


def _pingpong(me: int, peer: int, leader: bool, payload: torch.Tensor, ack: torch.Tensor, iters: int,
              pick: Any = statistics.median) -> float:
    """Seconds of one exchange (``pick`` of the iterations): the leader sends ``payload`` and waits for ``ack``;
    the peer mirrors."""
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
    return float(pick(times[1:]))


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

    def __init__(self, leaders: Sequence[int], rank: int, size: int, iters: int, device: torch.device) -> None:
        import torch

        self.leaders, self.rank, self.iters = list(leaders), rank, iters
        self.payload = torch.empty(max(size // 4, 1), dtype=torch.float32, device=device).fill_(1.0)
        self.ack = torch.zeros(1, dtype=torch.float32, device=device)
        self.size = self.payload.numel() * self.payload.element_size()
        self.mine: dict[Pair, Link] = {}
        self.seconds: list[float] = []

    def run(self, rounds: Sequence[Sequence[Pair]]) -> dict[Pair, Link]:
        """Measure ``rounds`` (collective: every rank calls it); every rank gets every pair's figures."""
        import torch.distributed as dist

        for pairs in rounds:
            t0 = time.perf_counter()
            for i, j in pairs:
                a, b = self.leaders[i], self.leaders[j]
                if self.rank in (a, b):
                    peer = b if self.rank == a else a
                    small = _pingpong(self.rank, peer, self.rank == a, self.ack.clone(), self.ack, self.iters,
                                          pick=min) / 2
                    big = _pingpong(self.rank, peer, self.rank == a, self.payload, self.ack, self.iters)
                    if self.rank == a:
                        self.mine[(i, j)] = (self.size / big / 1e9 if big > 0 else 0.0, small * 1e6)
            dist.barrier()
            self.seconds.append(time.perf_counter() - t0)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.mine)
        return {p: link for part in everyone for p, link in part.items()}


def _suspects(n: int, plan: Sequence[Sequence[Pair]], ring: Mapping[Pair, Link], threshold: float
              ) -> tuple[list[int], list[int]]:
    """From the ring pass: the endpoints of slow ring links (slow overall and within their round), and up to
    REFERENCES healthy endpoints (the fastest)."""
    _, _, overall, _ = judge_links(n, ring, threshold)
    suspects = sorted({e for p in _named(plan, ring, overall, threshold) for e in p})
    if not suspects:
        return [], []
    best = {e: max(bw for p, (bw, _) in ring.items() if e in p) for e in range(n) if e not in suspects}
    return suspects, sorted(sorted(best, key=lambda e: -best[e])[:REFERENCES])


def _named(plan: Sequence[Sequence[Pair]], links: Mapping[Pair, Link], overall: Sequence[Pair],
           threshold: float) -> list[Pair]:
    """Links slow overall and within their round (overall alone in a round of one pair)."""
    named = []
    for pairs in plan:
        _, in_round = judge_round(pairs, links, threshold)
        named += [p for p in pairs if p in overall and (p in in_round or len(pairs) < 2)]
    return sorted(set(named))


def measure_pairs(*, mode: str, size: int, iters: int, threshold: float, rank: int, world_size: int,
                  device: torch.device, schedule: str = "rounds") -> PairsResult:
    """Measure pairs of endpoints on ``schedule`` and judge them; collective: every rank must call it."""
    mode, names, leaders, note = _endpoints(mode, rank, world_size)
    n = len(leaders)
    runner = _Rounds(leaders, rank, size, iters, device)
    suspects: list[int] = []
    if schedule == "sequential":
        plan = [[(i, j)] for i in range(n) for j in range(i + 1, n)]
        links = runner.run(plan)
    elif schedule == "ring":
        plan = ring_rounds(n)
        links = runner.run(plan)
        suspects, references = _suspects(n, plan, links, threshold)
        chosen = suspects + references
        second = [sorted((min(chosen[a], chosen[b]), max(chosen[a], chosen[b])) for a, b in r)
                  for r in round_robin(len(chosen))] if suspects else []
        links.update(runner.run(second))
        plan = plan + second
    else:
        plan = round_robin(n)
        links = runner.run(plan)
    ref_bw, ref_lat, overall, slow = judge_links(n, links, threshold)
    named = _named(plan, links, overall, threshold)
    doubtful = [p for p in named if p[0] not in slow and p[1] not in slow]
    for e in slow:  # an endpoint is named by its best link: measure that once more too
        best = max((p for p in links if e in p), key=lambda p: links[p][0])
        doubtful += [best] if best not in doubtful else []
    confirm = matchings(doubtful)
    if confirm:  # every rank computed the same verdict from the same figures: all take part
        for p, (bw, lat) in runner.run(confirm).items():
            links[p] = (max(bw, links[p][0]), min(lat, links[p][1]))
        ref_bw, ref_lat, overall, slow = judge_links(n, links, threshold)
        named = _named(plan, links, overall, threshold)
    rounds = []
    for k, (pairs, seconds) in enumerate(zip(plan + confirm, runner.seconds, strict=True)):
        median, in_round = judge_round(pairs, links, threshold)
        rounds.append({"pairs": list(pairs), "seconds": round(seconds, 4), "median_bw": median, "slow": in_round,
                       "confirm": k >= len(plan)})
    slow_links = named
    return PairsResult(mode=mode, schedule=schedule, names=tuple(names), leaders=tuple(leaders), links=links,
                       rounds=tuple(rounds), size=runner.size, threshold=threshold, reference_bw=ref_bw,
                       reference_latency_us=ref_lat, slow_links=tuple(sorted(set(slow_links))),
                       slow_endpoints=tuple(slow), suspects=tuple(suspects), seconds=sum(runner.seconds), note=note)


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
