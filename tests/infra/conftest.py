"""Hosts for multi-host tests: network namespaces on a private switch (scripts/nshosts.py), an etcd server on
the switch, and ddpkit or torchrun started on a host with its output kept in files.

Every host gets its own address, hostname and /etc/hosts (its hostname resolving to 127.0.1.1, as Debian
installs it). Names, subnet and ports derive from a per-test run id. Teardown kills every process left in the
hosts (by PID, through ``ip netns pids``) and deletes the namespaces, whether the test passed or not.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from scripts.nshosts import Cluster, Host, create

from tests.helpers import ddpkit_env, require_root, require_tools

NS_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "hostname")


@dataclass
class HostRun:
    """A process started on a namespace host; its stdout and stderr go to files (no pipe to fill up)."""

    host: Host
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    started: float = field(default_factory=time.monotonic)
    seconds: float | None = None

    def wait(self, timeout: float) -> HostRun:
        """Wait for the exit; on timeout kill the process group and fail the test with the output so far."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"{self.host.name} did not finish within {timeout} s\n{self.output()}")
        self.seconds = time.monotonic() - self.started
        return self

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def output(self) -> str:
        return f"--- {self.host.name} exit {self.proc.poll()} stdout:\n{self.stdout}\n--- stderr:\n{self.stderr}"


class Hosts:
    """A :class:`Cluster` plus helpers to start ddpkit and torchrun on its hosts."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.hosts = cluster.hosts
        self._n = 0

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def start(self, host: Host, argv: list[str], cwd: Path | None = None, **env: str) -> HostRun:
        self._n += 1
        stem = Path(self.cluster.workdir) / f"{host.name}-{self._n}"
        out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
        with out.open("wb") as o, err.open("wb") as e:
            proc = self.cluster.popen(host, argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                      env=ddpkit_env(**env), cwd=cwd)
        return HostRun(host=host, proc=proc, out=out, err=err)

    def ddpkit(self, host: Host, *args: str, cwd: Path | None = None, **env: str) -> HostRun:
        """``python -m ddpkit ARGS`` on ``host`` (in ``cwd`` where given)."""
        return self.start(host, [sys.executable, "-m", "ddpkit", *args], cwd=cwd, **env)

    def endpoint(self, port: int = 29400) -> str:
        """The c10d rendezvous endpoint on the first host."""
        return f"{self.hosts[0].ip}:{port}"

    def leftover(self, grace: float = 10.0) -> dict[str, list[int]]:
        """Processes still alive in each host after ``grace`` seconds (empty when everything exited)."""
        deadline = time.monotonic() + grace
        while True:
            left = {h.name: self.cluster.pids(h) for h in self.hosts}
            left = {k: v for k, v in left.items() if v}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def new_run_id() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def make_hosts() -> Iterator[Callable[[int], Hosts]]:
    """Factory: ``make_hosts(n)`` creates n namespace hosts; all are torn down at the end of the test."""
    require_root("network namespaces")
    require_tools(*NS_TOOLS)
    made: list[Cluster] = []

    def make(n: int) -> Hosts:
        cluster = create(n, new_run_id())
        made.append(cluster)
        return Hosts(cluster)

    try:
        yield make
    finally:
        for cluster in made:
            cluster.down()


@pytest.fixture
def two_hosts(make_hosts: Callable[[int], Hosts]) -> Hosts:
    return make_hosts(2)


@dataclass(frozen=True)
class Etcd:
    endpoint: str
    """host:port of the client URL, reachable from every host."""
    proc: subprocess.Popen[bytes]


def start_etcd(cluster: Cluster, timeout: float = 60) -> Etcd:
    """A real etcd (v2 API on) in the switch namespace, on per-run ports and data dir, ready to serve."""
    offset = zlib.crc32(cluster.run_id.encode()) % 1000
    client, peer = 23000 + 2 * offset, 23001 + 2 * offset
    name = f"etcd-{cluster.run_id}"
    log = Path(cluster.workdir) / "etcd.log"
    with log.open("wb") as f:
        proc = cluster.popen(None, [
            "etcd", "--name", name, "--data-dir", str(Path(cluster.workdir) / "etcd"), "--enable-v2=true",
            "--listen-client-urls", f"http://{cluster.gateway}:{client}",
            "--advertise-client-urls", f"http://{cluster.gateway}:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"{name}=http://127.0.0.1:{peer}"],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not re.search(r"serving (insecure )?client requests", log.read_text(errors="replace")):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"etcd did not start (exit {proc.poll()}):\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return Etcd(endpoint=f"{cluster.gateway}:{client}", proc=proc)


@pytest.fixture
def etcd(two_hosts: Hosts) -> Etcd:
    """etcd on the two hosts' switch; stopped with the hosts."""
    require_tools("etcd")
    return start_etcd(two_hosts.cluster)
