#!/usr/bin/env python3
"""Several hosts on one machine: network namespaces on a private switch, each with its own address and hostname.

Needs root and iproute2 (``ip``, ``tc``), ``nsenter``/``unshare`` (util-linux). Nothing touches the root
namespace's network: the switch is a bridge inside its own namespace, and each host is a namespace with one veth
(``eth0``) plugged into it. Names and the /24 subnet derive from a run id, so parallel runs cannot clash.

    python scripts/nshosts.py up --hosts 2 --id run1          # creates h1, h2; prints their addresses
    python scripts/nshosts.py exec h1 --id run1 -- hostname   # runs a command on h1 (own hostname, /etc/hosts)
    python scripts/nshosts.py link h2 down --id run1          # unplugs h2's cable (and `up` plugs it back)
    python scripts/nshosts.py shape h2 --rate 100mbit --id run1   # tbf rate limit both ways (--rate off removes)
    python scripts/nshosts.py down --id run1                  # kills every process in the hosts, deletes them

Each host's /etc/hosts maps its own hostname to 127.0.1.1, as Debian installs it, and the other hosts to their
addresses: the common setup in which a process that trusts its hostname advertises a loopback address.
The switch namespace holds address .1 on the bridge, for services every host reaches (etcd in the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["Cluster", "Host", "create", "load"]

STATE_ROOT = Path(tempfile.gettempdir()) / "ddpkit-nshosts"
# mount the host's /etc/hosts, set its hostname, then become the command: argv is HOSTS HOSTNAME CMD...
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


@dataclass(frozen=True, kw_only=True)
class Host:
    """One namespace host."""

    name: str
    """Short name used on the command line: h1, h2, ..."""
    netns: str
    """Network namespace (``/run/netns/NAME``)."""
    hostname: str
    """Hostname inside the host (its own UTS namespace for every command run there)."""
    ip: str
    """Address of ``eth0``."""
    port: str
    """The switch-side end of its veth (cut it to take the host's link down)."""
    hosts_file: str
    """The file mounted over /etc/hosts for commands run on this host."""
    ifname: str = "eth0"
    """Interface inside the host."""


@dataclass(kw_only=True)
class Cluster:
    """A run's switch and hosts; every process started through it is killed at :meth:`down`."""

    run_id: str
    switch: str
    subnet: str
    gateway: str
    hosts: list[Host]
    workdir: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if name in (h.name, h.hostname, h.ip, h.netns):
                return h
        raise KeyError(f"no host {name!r} in run {self.run_id} (hosts: {', '.join(h.name for h in self.hosts)})")

    # -- running commands -------------------------------------------------------------------------------------
    def command(self, host: Host | str, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` on ``host``: its network, its hostname, its /etc/hosts."""
        h = self.host(host) if isinstance(host, str) else host
        return ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", _ENTER, "nshosts", h.hosts_file, h.hostname, *argv]

    def switch_command(self, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` in the switch namespace (services at the gateway address)."""
        return ["nsenter", f"--net=/run/netns/{self.switch}", *argv]

    def popen(self, host: Host | str | None, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (None: the switch) in its own process group; remembered for cleanup."""
        cmd = self.switch_command(argv) if host is None else self.command(host, argv)
        proc: subprocess.Popen[bytes] = subprocess.Popen(cmd, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def run(self, host: Host | str, argv: list[str], timeout: float = 60,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion; text output captured unless told otherwise."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(host, argv), text=True, timeout=timeout, check=False,  # type: ignore[call-overload]
                              **kwargs)

    def pids(self, host: Host | str | None = None) -> list[int]:
        """PIDs of every process living in ``host``'s network namespace (None: the switch's)."""
        ns = self.switch if host is None else (self.host(host) if isinstance(host, str) else host).netns
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]

    # -- the network ---------------------------------------------------------------------------------------------
    def link(self, host: Host | str, up: bool) -> None:
        """Plug (``up``) or unplug the host's cable at the switch; the host keeps its address and routes."""
        h = self.host(host) if isinstance(host, str) else host
        _ip("-n", self.switch, "link", "set", h.port, "up" if up else "down")

    def shape(self, host: Host | str, rate: str | None, burst: str = "32kbit") -> None:
        """Limit the host's link to ``rate`` (tbf, both directions); None removes the limit. ``burst``: the
        bucket; a larger one costs fewer timer wake-ups per byte when several links are limited at once."""
        h = self.host(host) if isinstance(host, str) else host
        for ns, dev in ((h.netns, h.ifname), (self.switch, h.port)):
            if rate is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, check=False)
            else:
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                      "burst", burst, "latency", "400ms"])

    # -- teardown ---------------------------------------------------------------------------------------------------
    def kill_all(self, grace: float = 2.0) -> list[int]:
        """Kill every process in the hosts and the switch: the process groups started here, then any PID left
        in the namespaces (workers of torch's agent run in their own sessions). Returns the PIDs killed."""
        killed: list[int] = []
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for _ in range(50):
            left = [pid for ns in [None, *self.hosts] for pid in self.pids(ns)]
            if not left:
                break
            for pid in left:
                _signal_pid(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.1)
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return sorted(set(killed))

    def down(self) -> None:
        """Kill everything started in the hosts, delete the namespaces and the run's files. Safe to repeat."""
        self.kill_all()
        for ns in [*(h.netns for h in self.hosts), self.switch]:
            if Path("/run/netns", ns).exists():
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def save(self) -> None:
        state = {k: v for k, v in asdict(self).items() if k != "procs"}
        Path(self.workdir, "state.json").write_text(json.dumps(state, indent=1))

    def describe(self) -> str:
        lines = [f"run {self.run_id}: subnet {self.subnet}, switch {self.switch} (gateway {self.gateway})"]
        lines += [f"  {h.name}: {h.hostname} {h.ip} on {h.ifname} (netns {h.netns})" for h in self.hosts]
        return "\n".join(lines)


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def clean_id(run_id: str) -> str:
    cleaned = re.sub(r"[^a-z0-9]", "", run_id.lower())
    if not cleaned or len(cleaned) > 20:
        raise ValueError(f"run id {run_id!r}: use 1-20 letters or digits")
    return cleaned


def subnet_for(run_id: str) -> str:
    """A /24 in 10.0.0.0/8 derived from the run id: ``10.A.B.0/24`` with A in 100..227."""
    h = zlib.crc32(run_id.encode())
    return f"10.{100 + h % 128}.{(h >> 8) % 256}.0/24"


def create(n_hosts: int, run_id: str) -> Cluster:
    """Create the switch and ``n_hosts`` hosts for ``run_id``; on any failure, undo what was made."""
    if os.geteuid() != 0:
        raise PermissionError("network namespaces need root")
    if not 1 <= n_hosts <= 200:
        raise ValueError(f"--hosts {n_hosts}: 1 to 200")
    rid = clean_id(run_id)
    prefix = f"ddpk-{rid}"
    taken = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    if re.search(rf"^{re.escape(prefix)}-", taken, re.M):
        raise FileExistsError(f"namespaces for run {rid} exist already (`nshosts.py down --id {rid}` removes them)")
    net = subnet_for(rid).rsplit(".", 1)[0]
    workdir = STATE_ROOT / rid
    workdir.mkdir(parents=True, exist_ok=True)
    hosts = [Host(name=f"h{i}", netns=f"{prefix}-h{i}", hostname=f"h{i}-{rid}", ip=f"{net}.{10 + i}",
                  port=f"port{i}", hosts_file=str(workdir / f"hosts-h{i}")) for i in range(1, n_hosts + 1)]
    cluster = Cluster(run_id=rid, switch=f"{prefix}-sw", subnet=f"{net}.0/24", gateway=f"{net}.1", hosts=hosts,
                      workdir=str(workdir))
    try:
        _ip("netns", "add", cluster.switch)
        _ip("-n", cluster.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", cluster.switch, "addr", "add", f"{cluster.gateway}/24", "dev", "br0")
        _ip("-n", cluster.switch, "link", "set", "br0", "up")
        _ip("-n", cluster.switch, "link", "set", "lo", "up")
        for h in hosts:
            _ip("netns", "add", h.netns)
            _ip("-n", cluster.switch, "link", "add", h.port, "type", "veth", "peer", "name", h.ifname,
                "netns", h.netns)
            _ip("-n", cluster.switch, "link", "set", h.port, "master", "br0", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            others = "".join(f"{o.ip}\t{o.hostname} {o.name}\n" for o in hosts if o is not h)
            Path(h.hosts_file).write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{h.hostname} {h.name}\n{others}"
                                          f"{cluster.gateway}\tswitch\n")
        cluster.save()
    except BaseException:
        cluster.down()
        raise
    return cluster


def load(run_id: str) -> Cluster:
    """The cluster ``up`` made for ``run_id`` (from its state file)."""
    rid = clean_id(run_id)
    path = STATE_ROOT / rid / "state.json"
    if not path.exists():
        raise FileNotFoundError(f"no hosts for run {rid} ({path} is missing): run `nshosts.py up --id {rid}` first")
    state = json.loads(path.read_text())
    state["hosts"] = [Host(**h) for h in state["hosts"]]
    return Cluster(**state)


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--id", default=os.environ.get("NSHOSTS_ID"), required="NSHOSTS_ID" not in os.environ,
                        help="run id (letters and digits; default $NSHOSTS_ID)")
    p = argparse.ArgumentParser(prog="nshosts.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", parents=[common], help="create the switch and the hosts")
    up.add_argument("--hosts", type=int, default=2)
    ex = sub.add_parser("exec", parents=[common], help="run a command on a host: exec HOST -- CMD...")
    ex.add_argument("host")
    ln = sub.add_parser("link", parents=[common], help="take a host's link down or up")
    ln.add_argument("host")
    ln.add_argument("state", choices=["down", "up"])
    sh = sub.add_parser("shape", parents=[common], help="rate-limit a host's link (tbf)")
    sh.add_argument("host")
    sh.add_argument("--rate", required=True, help="tc rate such as 100mbit; 'off' removes the limit")
    sub.add_parser("pids", parents=[common], help="list the processes living in each host")
    sub.add_parser("down", parents=[common], help="kill every process in the hosts and delete them")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        if args.cmd == "up":
            print(create(args.hosts, args.id).describe())
            return 0
        cluster = load(args.id)
        if args.cmd == "exec":
            if not command:
                p.error("exec HOST -- CMD...: no command given")
            return subprocess.call(cluster.command(args.host, command))
        if args.cmd == "link":
            cluster.link(args.host, args.state == "up")
        elif args.cmd == "shape":
            cluster.shape(args.host, None if args.rate == "off" else args.rate)
        elif args.cmd == "pids":
            for h in [None, *cluster.hosts]:
                print(f"{'switch' if h is None else h.name}: {' '.join(map(str, cluster.pids(h))) or '-'}")
        elif args.cmd == "down":
            cluster.down()
    except (RuntimeError, KeyError, FileNotFoundError, FileExistsError, ValueError, PermissionError) as exc:
        print(f"nshosts.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
