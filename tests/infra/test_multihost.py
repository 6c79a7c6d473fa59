"""Namespace hosts are hosts, and plain torchrun across two of them (2 ranks each) works with ddpkit inside.

(`ddpkit check` and `bench` across hosts, c10d and etcd: test_multihost_commands.py; drills with `train`:
test_multihost_drills.py.)

Each host's name resolves to 127.0.1.1 there, so these runs pass only because ddpkit picks the interface that
routes to the master (GLOO_SOCKET_IFNAME) and the first host's agent decides by itself to host the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.infra.conftest import HostRun, Hosts, new_run_id

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
RUN_TIMEOUT = 240  # seconds for one 2x2 run on a loaded 2-core machine (about 15 s when idle)


def _rows(*runs: HostRun) -> list[dict[str, object]]:
    rows = [json.loads(line) for r in runs for line in r.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: int(r["rank"]))  # type: ignore[call-overload]


def _assert_world_across(hosts: Hosts, runs: list[HostRun], master: str | None = None) -> None:
    """Four ranks, two per host, one verified all_reduce; ``master`` is the first host unless told."""
    for r in runs:
        assert r.returncode == 0, r.output()
    rows = _rows(*runs)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3], "\n".join(r.output() for r in runs)
    for row in rows:
        assert row["launcher"] == "torchrun" and row["world_size"] == 4 and row["num_nodes"] == 2
        assert row["connect"]["all_reduce_ok"] is True and row["connect"]["all_reduce"] == 10.0  # type: ignore[index]
    # the master is node 0's own address, never a loopback or a hostname resolving to one
    masters = {r["master_addr"] for r in rows}
    assert masters == {master or hosts[0].ip} and masters <= {h.ip for h in hosts.hosts}
    by_node = {n: sorted(int(row["rank"]) for row in rows if row["node_rank"] == n)  # type: ignore[call-overload]
               for n in (0, 1)}
    assert by_node == {0: [0, 1], 1: [2, 3]}
    for r in runs:  # each host's ranks chose its own eth0, and said why
        assert f"setting GLOO_SOCKET_IFNAME=eth0: eth0 ({r.host.ip}) is the interface that routes to the master " \
               f"{rows[0]['master_addr']}" in r.stderr, r.output()


def test_hosts_have_own_addresses_names_and_routes(two_hosts: Hosts) -> None:
    """The fixture's hosts are hosts: own hostname, own address; netinfo.route_to names the right interface."""
    h1, h2 = two_hosts[0], two_hosts[1]
    probe = ("import json, socket; from ddpkit.base.netinfo import route_to, is_local_address; "
             f"print(json.dumps([socket.gethostname(), route_to('{h1.hostname}'), route_to('{h2.ip}'), "
             f"is_local_address('{h1.ip}'), is_local_address('{h2.ip}'), "
             f"socket.create_connection(('{h1.ip}', 9), 5) and 1]))")
    listener = two_hosts.start(h1, [sys.executable, "-c", "import socket, time; s = socket.socket(); "
                                    "s.bind(('0.0.0.0', 9)); s.listen(); c, _ = s.accept(); print('accepted')"])
    got = None
    for _ in range(50):  # the listener needs a moment to bind
        result = two_hosts.cluster.run(h2, [sys.executable, "-c", probe], timeout=60)
        if result.returncode == 0:
            got = json.loads(result.stdout)
            break
    assert got is not None, result.stderr
    # the route to the other host, and to this host's own address, both leave from eth0 (not lo)
    assert got == [h2.hostname, ["eth0", h2.ip], ["eth0", h2.ip], False, True, 1]
    assert listener.wait(30).returncode == 0 and "accepted" in listener.stdout
    cut = two_hosts.cluster.run(h1, ["hostname"])
    assert cut.stdout.strip() == h1.hostname


def test_plain_torchrun_2x2_c10d(two_hosts: Hosts) -> None:
    """Plain torchrun across the hosts (is_host and --local-addr by hand, as its users must); inside the ranks,
    ddpkit.init() still has to choose the interface, or gloo advertises 127.0.1.1."""
    run_id = new_run_id()
    runs = []
    for i, host in enumerate(two_hosts.hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", two_hosts.endpoint(), "--rdzv-id", run_id,
                "--local-addr", host.ip, *(["--rdzv-conf", "is_host=true"] if i == 0 else []),
                "-m", "ddpkit", "env", "--connect", "--json", "--timeout", "120"]
        runs.append(two_hosts.start(host, argv))
    for r in runs:
        r.wait(RUN_TIMEOUT)
    _assert_world_across(two_hosts, runs)
    assert two_hosts.leftover() == {}


def test_nshosts_command_line() -> None:
    """scripts/nshosts.py standalone: up, exec (own hostname), link down/up, shape, down (kills what runs)."""
    from tests.helpers import require_root, require_tools
    from tests.infra.conftest import NS_TOOLS

    require_root("network namespaces")
    require_tools(*NS_TOOLS)
    rid = new_run_id()
    cli = [sys.executable, str(Path(__file__).parents[2] / "scripts" / "nshosts.py")]

    def nshosts(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=timeout)

    up = nshosts("up", "--hosts", "2", "--id", rid)
    try:
        assert up.returncode == 0, up.stderr
        assert f"h2: h2-{rid}" in up.stdout
        assert nshosts("exec", "h2", "--id", rid, "--", "hostname").stdout.strip() == f"h2-{rid}"
        reach = ["python3", "-c", f"import socket; socket.create_connection(('h1-{rid}', 9), 3)"]
        refused = nshosts("exec", "h2", "--id", rid, "--", *reach)
        assert "ConnectionRefused" in refused.stderr  # h1 answered: reachable, nothing listening
        assert nshosts("link", "h2", "down", "--id", rid).returncode == 0
        cut = nshosts("exec", "h2", "--id", rid, "--", *reach)
        assert "ConnectionRefused" not in cut.stderr and cut.returncode != 0  # no answer at all now
        assert nshosts("link", "h2", "up", "--id", rid).returncode == 0
        assert nshosts("shape", "h2", "--rate", "100mbit", "--id", rid).returncode == 0
        qdisc = subprocess.run(["ip", "netns", "exec", f"ddpk-{rid}-h2", "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        sleeper = subprocess.Popen([*cli, "exec", "h1", "--id", rid, "--", "sleep", "300"])
        time.sleep(1)
    finally:
        down = nshosts("down", "--id", rid)
    assert down.returncode == 0, down.stderr
    assert sleeper.wait(timeout=30) != 0  # killed by `down`
    assert f"ddpk-{rid}" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
