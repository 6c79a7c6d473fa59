"""Pure logic of ddpkit at scale: the round-robin and ring schedules of `bench --pairs`, judging within rounds and
on sparse measurements, the folded node table of `check`, and the DDP-sync loss at every world size."""

from __future__ import annotations

from itertools import combinations, pairwise
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.bench.pairs import _figure, format_pairs
from ddpkit.bench.schedules import judge_links, judge_round, ring_rounds, ring_suspects, round_robin, schedule_cost
from ddpkit.check import ddpsync
from ddpkit.check.render import fold_node, rank_ranges


@given(st.integers(min_value=2, max_value=130))
def test_round_robin_is_a_perfect_matching_every_round_and_covers_every_pair_once(n: int) -> None:
    rounds = round_robin(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    seen: list[tuple[int, int]] = []
    for pairs in rounds:
        playing = [e for p in pairs for e in p]
        assert len(playing) == len(set(playing)), f"an endpoint plays twice in one round: {pairs}"
        # perfect: everybody plays (even n); exactly one bye (odd n)
        assert len(playing) == n - n % 2
        assert all(0 <= a < b < n for a, b in pairs)
        seen += pairs
    assert sorted(seen) == list(combinations(range(n), 2)), "every pair exactly once"


@given(st.integers(min_value=2, max_value=130))
def test_ring_rounds_are_matchings_covering_every_neighbour_link(n: int) -> None:
    rounds = ring_rounds(n)
    assert len(rounds) == (1 if n == 2 else 2 if n % 2 == 0 else 3)
    links = [p for r in rounds for p in r]
    for pairs in rounds:
        playing = [e for p in pairs for e in p]
        assert len(playing) == len(set(playing))
    expected = {(min(i, (i + 1) % n), max(i, (i + 1) % n)) for i in range(n)}
    assert sorted(links) == sorted(expected)
    assert schedule_cost(n)["ring"] == len(rounds) and schedule_cost(n)["sequential"] == n * (n - 1) // 2


def _links(n: int, slow: int | None = None, bad_cable: tuple[int, int] | None = None) -> dict[Any, Any]:
    out = {}
    for p in combinations(range(n), 2):
        out[p] = (0.05, 900.0) if slow in p or p == bad_cable else (1.0, 50.0)
    return out


def test_judge_links_names_the_slow_endpoint_from_sparse_measurements() -> None:
    # only the ring and the suspects' pairs measured, as --ring does
    full = _links(8, slow=5)
    sparse = {p: full[p] for p in [(i, i + 1) for i in range(7)] + [(0, 7), (4, 6), (1, 5), (2, 5)]}
    ref_bw, _, links, endpoints = judge_links(8, sparse, 0.5)
    assert ref_bw == 1.0 and endpoints == [5] and all(5 in p for p in links)
    assert judge_links(8, {p: full[p] for p in sparse if 5 not in p}, 0.5)[2:] == ([], [])


def test_judge_round_compares_a_link_with_its_own_round() -> None:
    links = {(0, 1): (1.0, 50.0), (2, 3): (0.9, 55.0), (4, 5): (0.1, 60.0), (6, 7): (1.1, 45.0)}
    median, slow = judge_round(list(links), links, 0.5)
    assert slow == [(4, 5)] and 0.9 <= median <= 1.0
    # a round where the whole machine was slow names nothing
    everyone_slow = {p: (bw / 10, lat) for p, (bw, lat) in links.items() if p != (4, 5)}
    assert judge_round(list(everyone_slow), everyone_slow, 0.5)[1] == []


def test_format_pairs_states_the_cost_in_rounds() -> None:
    p = {"mode": "nodes", "schedule": "ring", "names": [f"h{i}" for i in range(4)], "size": 1 << 20,
         "bandwidth_gbps": [[0.0, 1.0, None, 1.0], [1.0, 0.0, 1.0, None], [None, 1.0, 0.0, 1.0],
                            [1.0, None, 1.0, 0.0]],
         "latency_us": [[0.0, 5.0, None, 5.0], [5.0, 0.0, 5.0, None], [None, 5.0, 0.0, 5.0], [5.0, None, 5.0, 0.0]],
         "rounds": [{"pairs": [["h0", "h1"], ["h2", "h3"]], "seconds": 0.1, "median_bw": 1.0, "slow": []},
                    {"pairs": [["h1", "h2"], ["h0", "h3"]], "seconds": 0.1, "median_bw": 1.0, "slow": []}],
         "suspects": [], "cost": {"rounds": 2, "pairs_measured": 4, "seconds": 0.2,
                                  "would_take_rounds": schedule_cost(4)},
         "reference_bw": 1.0, "reference_latency_us": 5.0, "threshold": 0.5, "slow_links": [], "slow_endpoints": []}
    text = format_pairs(p)
    assert "# cost: 2 round(s), 4 pair(s) measured" in text and "every pair takes 3 rounds" in text
    assert "6 one pair at a time" in text and "ring suspects: none" in text and "# slow nodes: none" in text


def _rec(rank: int, **extra: Any) -> dict[str, Any]:
    r = {"rank": rank, "host": "n1", "world_size": 64, "local_world_size": 64, "group_rank": 0, "pid": 100 + rank,
         "device": "cpu", "gpu_uuid": None, "threads": 1, "iface": "eth0", "ip": "10.0.0.1", "launcher": "torchrun",
         "python": "3.11.7", "torch": "2.13.0", "ddpkit": "0.1.0", "cuda": "none"}
    r.update(extra)
    return r


def test_fold_node_folds_ranks_and_names_the_ones_that_differ() -> None:
    rows = [_rec(r) for r in range(64) if r not in (40, 41)] + [_rec(40, threads=4), _rec(41, torch="2.1.0")]
    row = fold_node(rows)
    assert row["ranks"] == "0-63" and row["count"] == "64" and row["threads"] == "1"
    assert row["outliers"] == "rank 40: threads 4; rank 41: torch 2.1.0"
    assert fold_node([_rec(r) for r in range(8)])["outliers"] == "-"
    assert rank_ranges([0, 1, 2, 3, 8, 9, 11]) == "0-3, 8-9, 11"


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 32, 64, 256])
def test_ddp_sync_loss_falls_every_step_at_every_world_size(world: int) -> None:
    """The loss of the one-process reference on the union of every rank's batch (DDP's loss, averaged over the
    ranks): at 32 ranks it went 0.93 -> 349.9 in five steps when the targets grew with the rank."""
    losses, _ = ddpsync.reference_losses(world)
    assert all(b < a for a, b in pairwise(losses)), losses
    assert losses[0] < 5.0


def test_a_pair_cut_short_is_judged_on_its_largest_transfer_not_the_burst() -> None:
    # a token bucket lets the first 64 KiB through at once: that transfer must not make a slow link look fast
    ramp = [(64 << 10, 0.0001), (256 << 10, 0.08)]
    bw, cut = _figure(ramp, 1 << 20, 5)
    assert bw == (256 << 10) / 0.08 and cut
    whole = [(64 << 10, 0.001), (256 << 10, 0.002), *[(1 << 20, t) for t in (0.01, 0.004, 0.005, 0.006, 0.5)]]
    bw, cut = _figure(whole, 1 << 20, 5)
    assert bw == (1 << 20) / 0.006 and not cut  # the median of the five whole transfers
    alone = [(1 << 16, 0.002), *[(1 << 16, 0.001)] * 3]  # --pairs-size 64K: the first exchange is the warm-up
    assert _figure(alone, 1 << 16, 3) == ((1 << 16) / 0.001, False)


def test_ring_suspects_a_slow_host_alone_and_both_ends_of_an_unexplained_slow_link() -> None:
    assert ring_suspects([(4, 5), (5, 6)]) == [5]  # host 5: both its ring links slow; 4 and 6 are cleared
    assert ring_suspects([(2, 3)]) == [2, 3]  # one slow link: a cable, or either host
    assert ring_suspects([(0, 1), (1, 2), (2, 3)]) == [1, 2]  # two slow hosts side by side
    assert ring_suspects([(0, 1), (1, 2), (6, 7)]) == [1, 6, 7]
    assert ring_suspects([(0, 15), (0, 1)]) == [0]  # the closing link counts like any other
    assert ring_suspects([]) == []
