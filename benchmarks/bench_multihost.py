"""Multi-host on one machine (namespace hosts): what a run across hosts costs, and how fast failures surface.

    sudo python -m benchmarks.bench_multihost      # root: network namespaces; about 4 minutes on 2 cores

Measured side by side, repeated:
- time to a verified world of 4 ranks: ``ddpkit env -j 2x2 --connect`` across two hosts vs ``-n 4`` on one;
- a host that never starts: seconds until ``ddpkit env -j 2x2`` exits 3, against its ``--timeout``;
- TCP throughput between two hosts, unlimited and under ``tc tbf rate 100mbit`` (does the drill's limit hold).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from scripts.nshosts import Cluster, create
from tests.helpers import ddpkit_env

RESULTS = Path(__file__).parent / "results"
REPEATS = 3
MISSING_TIMEOUT = 10
SEND = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001), 10)
buf = b"x" * 65536
t = time.perf_counter()
for _ in range(int(sys.argv[2]) // 65536):
    s.sendall(buf)
s.shutdown(socket.SHUT_WR); s.recv(1)
print(int(sys.argv[2]) / (time.perf_counter() - t))
"""
RECV = """
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 5001)); srv.listen(); print("ready", flush=True)
c, _ = srv.accept()
while c.recv(1 << 20):
    pass
c.sendall(b"k")
"""


def _ddpkit(cluster: Cluster | None, host: int, *args: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "ddpkit", *args]
    kw = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": ddpkit_env()}
    if cluster is None:
        return subprocess.Popen(argv, **kw)  # type: ignore[call-overload]
    return cluster.popen(cluster.hosts[host], argv, **kw)


def _timed(procs: list[subprocess.Popen[bytes]], expect: int) -> float:
    t = time.monotonic()
    codes = [p.wait(timeout=600) for p in procs]
    if codes != [expect] * len(procs):
        raise RuntimeError(f"exit codes {codes}, expected {expect}")
    return time.monotonic() - t


def world_times(cluster: Cluster) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"across 2 hosts (-j 2x2)": [], "one host (-n 4)": []}
    for _ in range(REPEATS):
        args = ["env", "-j", "2x2", "--rdzv-endpoint", f"{cluster.hosts[0].ip}:29400", "--run-id",
                uuid.uuid4().hex[:8], "--connect"]
        t = time.monotonic()
        _timed([_ddpkit(cluster, 0, *args), _ddpkit(cluster, 1, *args)], 0)
        out["across 2 hosts (-j 2x2)"].append(time.monotonic() - t)
        t = time.monotonic()
        _timed([_ddpkit(None, 0, "env", "-n", "4", "--connect")], 0)
        out["one host (-n 4)"].append(time.monotonic() - t)
    return out


def missing_host_times(cluster: Cluster) -> list[float]:
    times = []
    for _ in range(REPEATS):
        args = ["env", "-j", "2x2", "--rdzv-endpoint", f"{cluster.hosts[0].ip}:29400", "--run-id",
                uuid.uuid4().hex[:8], "--connect", "--timeout", str(MISSING_TIMEOUT)]
        t = time.monotonic()
        _timed([_ddpkit(cluster, 0, *args)], 3)
        times.append(time.monotonic() - t)
    return times


def throughput(cluster: Cluster, rate: str | None, size: int) -> list[float]:
    cluster.shape(cluster.hosts[1], rate)
    rates = []
    for _ in range(REPEATS):
        recv = cluster.popen(cluster.hosts[0], [sys.executable, "-c", RECV], stdout=subprocess.PIPE)
        assert recv.stdout is not None
        recv.stdout.readline()
        sent = cluster.run(cluster.hosts[1], [sys.executable, "-c", SEND, cluster.hosts[0].ip, str(size)], timeout=120)
        recv.wait(timeout=30)
        rates.append(float(sent.stdout) / 1e6)
    cluster.shape(cluster.hosts[1], None)
    return rates


def main() -> None:
    if os.geteuid() != 0:
        print("bench_multihost: skipped, network namespaces need root (results unchanged)")
        return
    cluster = create(2, "bench" + uuid.uuid4().hex[:6])
    try:
        worlds = world_times(cluster)
        missing = missing_host_times(cluster)
        tcp = {"unlimited": throughput(cluster, None, 256 << 20),
               "tbf 100mbit": throughput(cluster, "100mbit", 16 << 20)}
    finally:
        cluster.down()
    med = statistics.median
    result = {"repeats": REPEATS, "world_s": worlds, "missing_host_exit_s": missing,
              "missing_timeout_s": MISSING_TIMEOUT, "tcp_MBps": tcp}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_multihost.json").write_text(json.dumps(result, indent=1))
    across, local = med(worlds["across 2 hosts (-j 2x2)"]), med(worlds["one host (-n 4)"])
    lines = [
        "# Multi-host on one machine (namespace hosts)", "",
        f"2 cores, shared with other work; medians of {REPEATS} runs (all runs in the JSON).", "",
        "| measurement | median | runs |", "|---|---|---|",
        f"| verified 4-rank world, 2 hosts x 2 (`env -j 2x2 --connect`) | {across:.1f} s | "
        f"{', '.join(f'{x:.1f}' for x in worlds['across 2 hosts (-j 2x2)'])} |",
        f"| verified 4-rank world, 1 host (`env -n 4 --connect`) | {local:.1f} s | "
        f"{', '.join(f'{x:.1f}' for x in worlds['one host (-n 4)'])} |",
        f"| a host never starts: exit 3 after (`--timeout {MISSING_TIMEOUT}`) | {med(missing):.1f} s | "
        f"{', '.join(f'{x:.1f}' for x in missing)} |",
        f"| TCP h2 -> h1, no limit | {med(tcp['unlimited']):.0f} MB/s | "
        f"{', '.join(f'{x:.0f}' for x in tcp['unlimited'])} |",
        f"| TCP h2 -> h1, `tbf rate 100mbit` (12.5 MB/s) | {med(tcp['tbf 100mbit']):.1f} MB/s | "
        f"{', '.join(f'{x:.1f}' for x in tcp['tbf 100mbit'])} |",
        "", f"Across hosts costs {across / local:.2f}x the single-host start (a second agent, the node rendezvous). "
        f"A missing host is reported {med(missing) - MISSING_TIMEOUT:.1f} s after its deadline (start-up and exit), "
        "not after torch's default 600 s.",
    ]
    (RESULTS / "bench_multihost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
