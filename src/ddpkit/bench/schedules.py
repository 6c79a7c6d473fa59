"""Which pairs the slow-link finder (``bench/pairs.py``) measures when, and how it judges them: pure logic.

Schedules (the cost of each, in rounds, is printed with the result; a round takes about one pair's time):

- ``rounds`` (default): every pair, as a round-robin tournament (the circle method): N-1 rounds for N endpoints
  (N for odd N, one endpoint sits out each round), each round a perfect matching whose pairs are measured at the
  same time. On a non-blocking fabric the pairs of a round share no link, so they do not disturb each other.
- ``ring``: a quick pass, every endpoint against its two ring neighbours (2 rounds; 3 for odd N), which names the
  suspects (an endpoint both of whose ring links are slow; both endpoints of a slow link no such endpoint explains);
  then every pair among the suspects and a few healthy references, in rounds. Cost 2 + (S+R-1) rounds for S
  suspects and R references, whatever N is.
- ``sequential``: one pair at a time, every other rank waiting at a barrier: N(N-1)/2 rounds (the old way; kept
  as the baseline the benchmark compares with).

Judging, overall: the reference bandwidth is the median over endpoints of each endpoint's *best* measured link
(what a healthy endpoint reaches). A link is slow when its bandwidth is below ``threshold`` x reference (or its
latency above reference latency / threshold); an endpoint is slow when even its best link is. With three
endpoints and one bad one, two of three links are bad, so a plain median of links would hide it; the best-link
median does not. Within each round: a link is also compared with the median of its own round, measured at the
same moment, so a round in which the whole (shared) machine slowed down does not name links; a link is named
slow only when it is slow both overall and within its round (rounds of one pair: overall alone). A slow link
between two endpoints that are not slow themselves, and one link of every slow endpoint, are measured again
(``confirm`` rounds, a matching of those links) and keep their better figure: a transient stall is not a bad
cable. A verdict changed by the confirmation can rest on other links measured once: those are confirmed in turn.
A named link between healthy endpoints is measured until it cleared or was measured ``1 + passes`` times, a slow
endpoint's links until one cleared or each was measured ``passes`` times (at most twice ``passes`` passes in all).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Mapping, MutableMapping, Sequence

__all__ = ["Link", "Pair", "confirm", "judge", "judge_links", "judge_round", "matchings", "named_links", "ring_rounds",
           "ring_suspects", "round_robin", "schedule_cost"]

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


def ring_suspects(slow: Sequence[Pair]) -> list[int]:
    """The endpoints to measure further, from the slow links of the ring pass. An endpoint both of whose ring
    links are slow is a suspect, and it explains them: its neighbours, whose other ring link is fine, are not (a
    slow host makes both its ring links slow; its neighbours' best links stay healthy, as in a full measurement).
    A slow link that no such endpoint explains (a bad cable, or a slow host next to another) makes both its
    endpoints suspects."""
    seen: dict[int, int] = {}
    for e in (e for p in slow for e in p):
        seen[e] = seen.get(e, 0) + 1
    both = {e for e, k in seen.items() if k >= 2}
    return sorted(both | {e for p in slow if not both & set(p) for e in p})


def named_links(plan: Sequence[Sequence[Pair]], links: Mapping[Pair, Link], overall: Sequence[Pair],
           threshold: float) -> list[Pair]:
    """Links slow overall and within their round (overall alone in a round of one pair)."""
    named = []
    for pairs in plan:
        _, in_round = judge_round(pairs, links, threshold)
        named += [p for p in pairs if p in overall and (p in in_round or len(pairs) < 2)]
    return sorted(set(named))


def confirm(n: int, plan: Sequence[Sequence[Pair]], links: MutableMapping[Pair, Link], threshold: float,
            measure: Callable[[list[list[Pair]]], Mapping[Pair, Link]], passes: int) -> list[list[Pair]]:
    """Measure again the links a verdict rests on (the module's text); each keeps its better figure in ``links``.
    ``measure`` runs rounds of pairs and returns their figures. Returns the confirmation rounds, in order.

    A link named between healthy endpoints is measured again in every pass while it stays named, ``passes`` times
    at most: a stall of a busy machine seldom lasts three measurements, a bad cable does. An endpoint named slow
    (all its links slow) has one of its links measured again in the same pass, the least measured (the best of
    those), until each was measured ``passes`` times: its best may be a bad cable, and a busy moment may have
    slowed its other links, twice. Those passes do not count against a link's own. Both seen in the suite's runs:
    a transient stall of one link outlasted its only confirmation while the two passes after it went to its
    endpoints' links, slow in a busy moment; an endpoint was named slow whose one healthy link read 10x slow twice.
    (Simulated, 3 endpoints, 20000 runs of a bad cable, a transient stall or a slow endpoint, with busy moments of
    up to two measurements on any link: all judged right, against 13021 by the earlier rule, three passes of
    every named link and each slow endpoint's links once; a slow endpoint costs 4 measurements again, not 2.)"""
    times: Counter[Pair] = Counter(p for pairs in plan for p in pairs)
    rounds: list[list[Pair]] = []
    for _ in range(2 * passes):
        _, _, overall, slow = judge_links(n, links, threshold)
        named = named_links(plan, links, overall, threshold)
        doubtful = [p for p in named if p[0] not in slow and p[1] not in slow and times[p] <= passes]
        for e in slow:  # one link of a slow endpoint a pass: the least measured, the best of those
            again = [p for p in links if e in p and p not in doubtful and times[p] < passes]
            if again:
                doubtful.append(min(again, key=lambda p: (times[p], -links[p][0])))
        if not doubtful:
            break
        matched = matchings(doubtful)  # every rank computed the same verdict from the same figures: all take part
        for p, (bw, lat) in measure(matched).items():
            links[p] = (max(bw, links[p][0]), min(lat, links[p][1]))
        rounds += matched
        times.update(doubtful)
    return rounds
