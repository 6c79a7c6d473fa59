"""A drill of live healing across namespace hosts without Slurm (``train -j Nx2 --rdzv-endpoint ... --heal live`` on
every host, ``--standby`` on the last): the job started, one host struck once it trains, what it left. Shared by
``test_heal_live_hosts.py`` and ``benchmarks/bench_live_heal_hosts.py``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpkit.rundir.ledger import Ledger, RankReplaced
from tests.infra.conftest import HostRun, Hosts, new_run_id

#: The reference job: 12 steps an epoch at world size 4 (about 0.1 s each here), a snapshot an epoch.
TRAIN = ("train", "--epochs", "80", "--samples", "1536", "--model", "toy")
RUN_TIMEOUT = 300
PORT = 29500


def start(hosts: Hosts, where: Path, *extra: str, nodes: int = 2, standby: int = 1, job: tuple[str, ...] = TRAIN,
          shape: str | None = None) -> list[HostRun]:
    """``nodes`` hosts of 2 ranks and ``standby`` standby hosts (the last ones), the endpoint on the first."""
    snaps = where / "snaps"
    snaps.mkdir(exist_ok=True)
    options = [job[0], "-j", shape or f"{nodes}x2", "--rdzv-endpoint", hosts.endpoint(PORT), "--run-id",
               new_run_id(), "--heal", "live", "--run-dir", str(where / "run"), *extra]
    if job[0] == "train":
        options += ["--snapshot-path", str(snaps / "snap.pt"), "--json", str(where / "summary.json")]
    return [hosts.ddpkit(h, *options, *(("--standby",) if i >= nodes else ()), *job[1:], cwd=where)  # before --
            for i, h in enumerate(hosts.hosts[: nodes + standby])]


def ranks_of(agent: int) -> list[int]:
    """The ranks an agent forked (its children)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == agent:
                found.append(int(entry))
    return sorted(found)


def heals_of(where: Path) -> list[RankReplaced]:
    run = where / "run"
    if not (run / "ledger.jsonl").exists():
        return []
    return [r for r in Ledger(run).records() if isinstance(r, RankReplaced)]


def until(what: Callable[[], bool], runs: list[HostRun], timeout: float, why: str) -> None:
    """Wait for ``what()``; the test fails, with every host's output, at the timeout or where the first host ended."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline or runs[0].returncode is not None:
            pytest.fail(f"{why} within {timeout} s\n" + "\n".join(r.output() for r in runs))
        time.sleep(0.05)


def strike(hosts: Hosts, where: Path, fault: str, *extra: str, target: int = 1, nodes: int = 2,
           job: tuple[str, ...] = TRAIN, ready: Callable[[], bool] | None = None,
           started: list[HostRun] | None = None, victim_s: float = 0.0) -> dict[str, Any]:
    """Start the job, strike host ``target`` (its member and ranks killed, stopped, or its link cut) once two
    snapshots are written (or ``ready()``; ``started`` is given the runs as they start), wait for the job; what it
    left."""
    runs = start(hosts, where, *extra, nodes=nodes, job=job)
    if started is not None:
        started.extend(runs)
    snaps = where / "snaps"
    until(ready or (lambda: len(list(snaps.glob("snap.*.pt"))) >= 2), runs, 180, "no two snapshots")
    kept = [pid for i, r in enumerate(runs[:nodes]) if i != target for pid in ranks_of(r.proc.pid)]
    victim = hosts[target]
    fault_at = time.time()
    if fault == "link":
        hosts.cluster.link(victim, up=False)
    else:
        for pid in hosts.cluster.pids(victim):
            os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    until(lambda: any(h.first_step_at for h in heals_of(where)), runs, 120, "no heal")
    alive = [pid for pid in kept if Path(f"/proc/{pid}").exists()]
    for run in runs:
        if run.host is not victim:
            run.wait(RUN_TIMEOUT)
    if victim_s:  # the struck host's own end, where it has one (``victim_s`` at most)
        with contextlib.suppress(subprocess.TimeoutExpired):
            runs[target].proc.wait(timeout=victim_s)
    for pid in hosts.cluster.pids(victim):  # stopped, or cut off: it goes on on its own until killed
        os.kill(pid, signal.SIGKILL)
    return {"runs": runs, "kept": kept, "alive": alive, "fault_at": fault_at, "heals": heals_of(where),
            "ledger": Ledger(where / "run").records(), "victim": victim}
