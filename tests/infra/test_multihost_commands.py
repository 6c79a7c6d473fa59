"""`ddpkit check` and `ddpkit bench` across two namespace hosts x two ranks, c10d and etcd-v2 rendezvous.

(`ddpkit train` across hosts runs in the drills: test_multihost_drills.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.infra.conftest import Etcd, Hosts, new_run_id

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
RUN_TIMEOUT = 300  # one 2x2 run on a loaded 2-core machine (about 30 s idle)


def _check_across(hosts: Hosts, *launch: str) -> tuple[dict, list[str]]:
    """Run ``ddpkit check`` (ddpkit's own multi-node launch) on both hosts with the same launch options;
    return rank 0's report and the hosts' stderr."""
    report = Path(hosts.cluster.workdir) / "check.json"
    runs = [hosts.ddpkit(h, "check", "--json", str(report), *launch) for h in hosts.hosts]
    for r in runs:
        r.wait(RUN_TIMEOUT)
        assert r.returncode == 0, r.output()
    assert hosts.leftover() == {}
    return json.loads(report.read_text()), [r.stderr for r in runs]


def _assert_check_passed(hosts: Hosts, report: dict, stderrs: list[str]) -> None:
    text = json.dumps(report)
    ranks = sorted((r["host"], r["rank"], r["iface"], r["ip"]) for r in report["ranks"])
    by_host = {h.hostname: sorted(r[1] for r in ranks if r[0] == h.hostname) for h in hosts.hosts}
    assert sorted(by_host.values()) == [[0, 1], [2, 3]], ranks
    # every rank reaches the master over its host's eth0, from its own address: the interface ddpkit chose
    assert {(host, iface, ip) for host, _, iface, ip in ranks} == {(h.hostname, "eth0", h.ip) for h in hosts.hosts}
    assert all(r["env"].get("GLOO_SOCKET_IFNAME") == "eth0" for r in report["ranks"])
    assert all("setting GLOO_SOCKET_IFNAME=eth0" in e for e in stderrs)
    assert "ddp-sync" in text
    assert report["passed"] is True and report["exit_code"] == 0, text[:3000]
    route = next(c for c in report["checks"] if c["name"] == "route-to-master")
    assert route["status"] == "PASS", route
    names = ", ".join(sorted(h.hostname for h in hosts.hosts))
    assert f"GLOO_SOCKET_IFNAME set by ddpkit on {names} to the interface that routes to the master" \
        in route["detail"], route  # check's report says which interface, and why


def test_check_2x2_c10d(two_hosts: Hosts) -> None:
    report, stderrs = _check_across(two_hosts, "-j", "2x2", "--rdzv-endpoint", two_hosts.endpoint(),
                                    "--run-id", new_run_id(), "--timeout", "120")
    _assert_check_passed(two_hosts, report, stderrs)
    assert report["ranks"][0]["master"].startswith(f"{two_hosts[0].ip}:")
    assert f"hosting the rendezvous store: {two_hosts[0].ip} is this host's own address" in stderrs[0]
    assert "hosting the rendezvous store" not in stderrs[1]


def test_check_2x2_etcd_v2(two_hosts: Hosts, etcd: Etcd) -> None:
    """The Kubernetes seed's rendezvous: a real etcd (v2 API) on the switch, torch's etcd-v2 backend."""
    report, stderrs = _check_across(two_hosts, "-j", "2x2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
                                    etcd.endpoint, "--run-id", new_run_id(), "--timeout", "120")
    _assert_check_passed(two_hosts, report, stderrs)
    assert not any("hosting the rendezvous store" in e for e in stderrs)  # etcd holds the rendezvous


def test_bench_2x2_c10d(two_hosts: Hosts) -> None:
    out = Path(two_hosts.cluster.workdir) / "bench.json"
    args = ["bench", "-j", "2x2", "--rdzv-endpoint", two_hosts.endpoint(), "--run-id", new_run_id(),
            "--ops", "all_reduce,all_gather", "-b", "1K", "-e", "1M", "-f", "32", "--iters", "5", "--json", str(out)]
    runs = [two_hosts.ddpkit(h, *args) for h in two_hosts.hosts]
    for r in runs:
        r.wait(RUN_TIMEOUT)
        assert r.returncode == 0, r.output()
    result = json.loads(out.read_text())
    assert result["passed"] is True, result
    text = json.dumps(result)
    for h in two_hosts.hosts:
        assert h.hostname in text  # the world spans both hosts
    assert two_hosts.leftover() == {}
