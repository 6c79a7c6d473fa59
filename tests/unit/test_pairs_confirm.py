"""`bench --pairs`'s confirmation of a verdict (bench.schedules.confirm), on the figures of two runs of the suite
(stop 43): a link's transient stall (its first two measurements) while the machine was busy for the other two links'
first measurement (the passes went to the endpoints' links, and the stalled link was named after one
confirmation); a bad cable while one endpoint's other link read 10x slow twice (that endpoint was named slow)."""

from __future__ import annotations

from collections import Counter

from ddpkit.bench.schedules import confirm, judge_links, named_links, round_robin

HEALTHY = {(0, 1): (0.216, 52.7), (0, 2): (0.213, 66.4), (1, 2): (0.216, 55.0)}
STALLED = (0.101, 10265.9)  # 20 ms before every send of rank 1 to rank 2
BUSY = (0.2, 200.0)


class Links:
    """Each link's figures by measurement: the first ones as given, then healthy (or always the first: a bad cable)."""

    def __init__(self, first: dict[tuple[int, int], list[tuple[float, float]]], bad: tuple[int, int] | None = None):
        self.first, self.bad, self.count = first, bad, Counter[tuple[int, int]]()

    def measure(self, rounds: list[list[tuple[int, int]]]) -> dict[tuple[int, int], tuple[float, float]]:
        out = {}
        for pairs in rounds:
            for p in pairs:
                i = self.count[p]
                self.count[p] += 1
                given = self.first.get(p, [])
                out[p] = STALLED if p == self.bad else given[i] if i < len(given) else HEALTHY[p]
        return out


def _verdict(links: Links) -> tuple[list[tuple[int, int]], list[int], list[list[tuple[int, int]]]]:
    plan = round_robin(3)
    figures = links.measure(plan)
    rounds = confirm(3, plan, figures, 0.5, links.measure, passes=3)
    _, _, overall, slow = judge_links(3, figures, 0.5)
    return named_links(plan, figures, overall, 0.5), slow, rounds


def test_a_transient_stall_is_cleared_though_busy_moments_took_passes_for_the_endpoints() -> None:
    links = Links({(0, 1): [BUSY], (0, 2): [BUSY], (1, 2): [STALLED, STALLED]})
    named, slow, _ = _verdict(links)
    assert (named, slow) == ([], [])
    assert links.count[(1, 2)] == 3  # its round, the stalled confirmation, the one that cleared it


def test_a_bad_cable_is_named_after_its_round_and_three_confirmations_and_no_more() -> None:
    links = Links({(0, 1): [BUSY], (0, 2): [BUSY]}, bad=(1, 2))
    named, slow, _ = _verdict(links)
    assert (named, slow) == ([(1, 2)], [])
    assert links.count[(1, 2)] == 4 and max(links.count.values()) <= 4


def test_a_bad_cable_does_not_make_an_endpoint_slow_whose_other_link_read_slow_twice() -> None:
    links = Links({(0, 2): [(0.020, 89.7), (0.020, 89.7)]}, bad=(1, 2))
    named, slow, _ = _verdict(links)
    assert (named, slow) == ([(1, 2)], [])
    assert max(links.count.values()) <= 4


def test_a_slow_endpoint_is_named_once_each_of_its_links_was_measured_three_times() -> None:
    slow_host = (0.02, 400.0)
    links = Links({(0, 2): [slow_host] * 9, (1, 2): [slow_host] * 9})
    named, slow, _ = _verdict(links)
    assert slow == [2] and named == [(0, 2), (1, 2)]
    assert links.count[(0, 2)] == links.count[(1, 2)] == 3


def test_a_healthy_run_measures_nothing_again() -> None:
    links = Links({})
    assert _verdict(links) == ([], [], [])
    assert sum(links.count.values()) == 3
