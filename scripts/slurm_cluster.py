#!/usr/bin/env python3
"""A real Slurm cluster on one machine, for tests: munged + slurmctld + one slurmd per node, each node a network
namespace with its own IP, hostname and /etc/hosts.

    sudo python3 scripts/slurm_cluster.py up   --dir /tmp/ddpkit-slurm   # prints the SLURM_CONF and client prefix
    sudo python3 scripts/slurm_cluster.py down --dir /tmp/ddpkit-slurm   # stops the daemons by PID, removes netns

How it is built (see ../shared/notes/infra-on-this-machine.md for why each piece is so):
- A run id names everything global: netns ``dj<id>a``/``dj<id>b``, veth ``vj<id>a``/``vj<id>b``, Slurm ports
  derived from it; so two test runs on one machine never meet. Addresses live inside the namespaces only
  (10.213.0.11, .12, ...), so they cannot clash with another run either.
- Each node is entered with ``nsenter --net=/run/netns/NS unshare --uts --mount``: own hostname, private
  ``/etc/hosts`` naming every node (bind-mounted), so torch, gloo and Slurm resolve node names to the node's
  own address. Not ``ip netns exec``: it remounts /sys and slurmd 22.05 dies ("No filesystem mounted on
  /sys/fs/cgroup").
- slurmctld runs beside the first node's slurmd, in that node's namespace; client commands (sbatch, squeue,
  scontrol) run there too (``client_prefix``) with ``SLURM_CONF`` pointing at this cluster's config.
- munged is this run's own (``--socket`` in the run directory, Slurm told through ``AuthInfo=socket=...``),
  using the machine's key, so no shared daemon is needed or touched.
- Every daemon runs in the foreground as a child of this script, so it is stopped by its PID, never by name.

Stdlib only: the test fixture (tests/infra/slurm_fixture.py) imports this file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.0"
MUNGE_KEY = Path("/etc/munge/munge.key")
TOOLS = ("munged", "munge", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scontrol", "ip", "nsenter",
         "unshare")


@dataclass
class Node:
    name: str
    ip: str
    netns: str
    veth: str

    def enter(self, hosts_file: Path) -> list[str]:
        """argv prefix running a command as this node: its network, its hostname, its /etc/hosts."""
        script = f'hostname {self.name} && mount --bind "$0" /etc/hosts && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--uts", "--mount", "--",
                "sh", "-c", script, str(hosts_file)]


@dataclass
class SlurmCluster:
    root: Path
    """Run directory: config, state, spool, logs, munge socket; removed by stop() unless keep=True."""
    nodes_count: int = 2
    cpus_per_node: int = 4
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    nodes: list[Node] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self.nodes = [Node(name=f"node{i + 1}", ip=f"{SUBNET}.{11 + i}", netns=f"dj{self.run_id}{chr(97 + i)}",
                           veth=f"vj{self.run_id}{chr(97 + i)}") for i in range(self.nodes_count)]
        # below ddpkit's derived torch ports (ddpkit.base.ports.PORT_RANGE, 20000-29999, from the job id): a slurmd on
        # 20001 once took the port that job 1's rank 0 needed for its store (EADDRINUSE)
        base = 12000 + (int(self.run_id, 16) % 3000) * 2
        self.ctld_port, self.slurmd_port = base, base + 1

    # -- paths and environment ------------------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client_prefix(self) -> list[str]:
        """argv prefix for client commands (sbatch, squeue, ddpkit submit): the controller node's namespace."""
        return self.nodes[0].enter(self.hosts_file)

    def client(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.client_prefix(), *argv], env=self.env(), capture_output=True, text=True,
                              timeout=timeout)

    # -- start -----------------------------------------------------------------------------------------------
    def start(self, timeout: float = 90) -> None:
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise RuntimeError(f"missing tools: {', '.join(missing)} (make infra-deps installs them)")
        try:
            self._write_files()
            self._network()
            self._munged()
            self._daemons()
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _write_files(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged runs as user munge and must reach its socket directory
        closed = [p for p in self.root.parents if not p.stat().st_mode & 0o001]
        if closed:
            raise RuntimeError(f"{closed[0]} is not searchable by others, so munged (user munge) cannot reach "
                               f"{self.root}: choose a run directory under /tmp, or chmod o+x {closed[0]}")
        for sub in ("state", "spool", "tmp", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "tmp" / node.name).mkdir(exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{n.ip} {n.name}" for n in self.nodes]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        r = self.root
        first = self.nodes[0]
        conf = [
            f"ClusterName=ddpkit{self.run_id}",
            f"SlurmctldHost={first.name}({first.ip})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # a preempted (requeued) job gets this long between SIGTERM and SIGKILL to save its snapshot
            "KillWait=20",
            "MinJobAge=600",
            "SchedulerParameters=sched_interval=1",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/slurmd-%n",
            f"TmpFS={r / 'tmp'}/%n",
            f"SlurmctldPidFile={r / 'log'}/slurmctld.pid",
            f"SlurmdPidFile={r / 'log'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log'}/slurmctld.log",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        conf += [f"NodeName={n.name} NodeAddr={n.ip} CPUs={self.cpus_per_node} State=UNKNOWN" for n in self.nodes]
        conf.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(conf) + "\n")

    def _network(self) -> None:
        if len(self.nodes) > 2:
            self._bridged_network()
            return
        a, b = self.nodes[0], self.nodes[1] if len(self.nodes) > 1 else None
        for node in self.nodes:
            _sh("ip", "netns", "add", node.netns)
        if b is not None:
            _sh("ip", "link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
        for node in self.nodes[:2]:
            if b is not None:
                _sh("ip", "link", "set", node.veth, "netns", node.netns)
                _sh("ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", node.veth)
                _sh("ip", "-n", node.netns, "link", "set", node.veth, "up")
            _sh("ip", "-n", node.netns, "link", "set", "lo", "up")
        if b is None:  # a single node: its address on a dummy device
            _sh("ip", "-n", a.netns, "link", "add", a.veth, "type", "dummy")
            _sh("ip", "-n", a.netns, "addr", "add", f"{a.ip}/24", "dev", a.veth)
            _sh("ip", "-n", a.netns, "link", "set", a.veth, "up")

    def _bridged_network(self) -> None:
        """Three nodes or more: a bridge in the first node's namespace (its address on the bridge), every other node
        plugged in by a veth pair (its end ``vj<id><letter>``, the bridge's ``pj<id><letter>``)."""
        a, bridge = self.nodes[0], f"bj{self.run_id}"
        for node in self.nodes:
            _sh("ip", "netns", "add", node.netns)
            _sh("ip", "-n", node.netns, "link", "set", "lo", "up")
        _sh("ip", "-n", a.netns, "link", "add", bridge, "type", "bridge")
        _sh("ip", "-n", a.netns, "addr", "add", f"{a.ip}/24", "dev", bridge)
        _sh("ip", "-n", a.netns, "link", "set", bridge, "up")
        for node in self.nodes[1:]:
            port = "p" + node.veth[1:]
            _sh("ip", "link", "add", node.veth, "type", "veth", "peer", "name", port)
            _sh("ip", "link", "set", node.veth, "netns", node.netns)
            _sh("ip", "link", "set", port, "netns", a.netns)
            _sh("ip", "-n", a.netns, "link", "set", port, "master", bridge)
            _sh("ip", "-n", a.netns, "link", "set", port, "up")
            _sh("ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", node.veth)
            _sh("ip", "-n", node.netns, "link", "set", node.veth, "up")

    def _munged(self) -> None:
        munge_dir = self.root / "munge"
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o755)
        self._spawn("munged", ["munged", "--foreground", f"--socket={self.munge_socket}",
                               f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
                               f"--seed-file={munge_dir / 'munged.seed'}", f"--key-file={MUNGE_KEY}"],
                    user="munge")
        proc = self.procs["munged"]

        def up() -> bool:
            if proc.poll() is not None:
                out = (self.root / "log" / "munged.stdout").read_text(errors="replace")
                raise RuntimeError(f"munged exited with {proc.returncode}: {out.strip()}")
            return self.munge_socket.exists()

        _until(up, 20, "munged socket", self.root)

    def _daemons(self) -> None:
        first = self.nodes[0]
        self._spawn("slurmctld", [*first.enter(self.hosts_file), "slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node.name}", [*node.enter(self.hosts_file), "slurmd", "-D", "-f", str(self.conf)])

    def _spawn(self, name: str, argv: list[str], user: str | None = None) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")  # noqa: SIM115 (lives as long as the daemon)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            user=user, start_new_session=True)
        log.close()

    def _wait_idle(self, timeout: float) -> None:
        def idle() -> bool:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; logs in {self.root / 'log'}")
            out = self.client("sinfo", "-h", "-N", "-o", "%N %T", timeout=20).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            return len(states) == len(self.nodes) and all(s == "idle" for s in states.values())

        _until(idle, timeout, "every node idle in sinfo", self.root)

    # -- stop ------------------------------------------------------------------------------------------------
    def stop(self, keep: bool = False) -> None:
        """Stop slurmd(s), slurmctld, munged by PID (TERM, then KILL after 10 s); delete the namespaces."""
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self._kill_leftover_jobs()
        for node in self.nodes:
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True, check=False)
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def _kill_leftover_jobs(self) -> None:
        """Job processes (slurmstepd and its tasks) outlive slurmd; kill those inside this run's namespaces."""
        for node in self.nodes:
            res = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=False)
            for pid in res.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def describe(self) -> dict[str, object]:
        return {"root": str(self.root), "run_id": self.run_id, "slurm_conf": str(self.conf),
                "client_prefix": self.client_prefix(), "nodes": [n.__dict__ for n in self.nodes],
                "pids": {k: p.pid for k, p in self.procs.items()}}


def _sh(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")


def _until(ok: object, timeout: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():  # type: ignore[operator]
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not reached within {timeout:.0f} s; logs in {root / 'log'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--dir", required=True, type=Path, help="run directory")
    p.add_argument("--nodes", type=int, default=2)
    args = p.parse_args()
    state = args.dir / "cluster.json"
    if args.action == "up":
        cluster = SlurmCluster(args.dir, nodes_count=args.nodes)
        cluster.start()
        state.write_text(json.dumps(cluster.describe(), indent=1))
        print(json.dumps(cluster.describe(), indent=1))
        print(f"export SLURM_CONF={cluster.conf}; prefix client commands with the client_prefix above")
        return 0
    desc = json.loads(state.read_text())
    for name in ("slurmd-" + n["name"] for n in desc["nodes"]):
        _kill(desc["pids"].get(name))
    _kill(desc["pids"].get("slurmctld"))
    _kill(desc["pids"].get("munged"))
    for node in desc["nodes"]:
        for pid in subprocess.run(["ip", "netns", "pids", node["netns"]], capture_output=True,
                                  text=True, check=False).stdout.split():
            _kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", node["netns"]], check=False)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


def _kill(pid: int | None, sig: int = signal.SIGTERM) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    for _ in range(40):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.25)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
