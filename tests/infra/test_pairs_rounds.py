"""`bench --pairs` in rounds and `bench --ring` across 8 namespace hosts: one host's link limited with tc tbf is
named by both; with no limited link neither names anything."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit.bench.schedules import schedule_cost
from tests.infra.conftest import Hosts, new_run_id

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
HOSTS = 8
RUN_TIMEOUT = 400
# Eight hosts on two cores: the four pairs of a round share the CPUs (on a real fabric each pair has its own
# hosts), so healthy links measure 0.2-1.8 GB/s here; 50 Mbit/s is about 0.006 GB/s, far below a fifth of that.
THRESHOLD = "0.2"


def _pairs(hosts: Hosts, *mode: str) -> dict:
    out = Path(hosts.cluster.workdir) / f"pairs-{new_run_id()}.json"
    args = ["bench", "-j", f"{HOSTS}x1", "--rdzv-endpoint", hosts.endpoint(), "--run-id", new_run_id(), *mode,
            "--pairs-size", "1M", "--pairs-iters", "5", "--pairs-threshold", THRESHOLD, "--json", str(out)]
    # eight single-rank hosts share two cores: one thread each
    runs = [hosts.ddpkit(h, *args, OMP_NUM_THREADS="1") for h in hosts.hosts]
    for r in runs:
        r.wait(RUN_TIMEOUT)
    codes = [r.returncode for r in runs]
    assert len(set(codes)) == 1 and codes[0] in (0, 1), "\n".join(r.output() for r in runs)
    pairs = json.loads(out.read_text())["pairs"]
    pairs["exit_code"], pairs["stdout"] = codes[0], runs[0].stdout
    return pairs


def test_rounds_and_ring_name_the_limited_host_and_nothing_without_it(make_hosts: Callable[[int], Hosts]) -> None:
    hosts = make_hosts(HOSTS)
    slow = hosts[5]
    hosts.cluster.shape(slow, "50mbit")
    rounds = _pairs(hosts, "--pairs")
    assert rounds["slow_endpoints"] == [slow.hostname] and rounds["exit_code"] == 1, rounds["stdout"]
    schedule = [r for r in rounds["rounds"] if not r["confirm"]]
    assert rounds["schedule"] == "rounds" and len(schedule) == HOSTS - 1
    assert all(len(r["pairs"]) == HOSTS // 2 for r in schedule)  # every round measures 4 pairs at once
    assert all(slow.hostname in link for link in rounds["slow_links"]) and len(rounds["slow_links"]) == HOSTS - 1, \
        rounds["stdout"]
    assert f"slow nodes: {slow.hostname}" in rounds["stdout"]

    ring = _pairs(hosts, "--ring")
    assert ring["slow_endpoints"] == [slow.hostname] and ring["exit_code"] == 1, ring["stdout"]
    # the ring pass (2 rounds), then every pair among the suspects and 2 healthy references
    assert slow.hostname in ring["suspects"], ring["stdout"]
    ring_schedule = [r for r in ring["rounds"] if not r["confirm"]]
    assert len(ring_schedule) == 2 + schedule_cost(len(ring["suspects"]) + 2)["rounds"], ring["stdout"]

    hosts.cluster.shape(slow, None)
    for mode in ("--pairs", "--ring"):
        healthy = _pairs(hosts, mode)
        assert healthy["slow_endpoints"] == [] and healthy["slow_links"] == [], healthy["stdout"]
        assert healthy["exit_code"] == 0 and "# slow nodes: none" in healthy["stdout"]
    assert hosts.leftover() == {}
