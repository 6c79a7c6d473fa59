"""pytest fixture: a real Slurm cluster of two network-namespace nodes (scripts/slurm_cluster.py), one per session.

Import the fixture into a test module (``from tests.infra.slurm_fixture import slurm_cluster_fixture``; tests then ask
for ``slurm_cluster``). The cluster is started
once (about 3 s), torn down by PID at the end of the session (daemons, leftover job processes, namespaces),
even when tests fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripts import slurm_cluster

from tests.helpers import ddpkit_env, require_root, require_tools

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture() -> Iterator[Any]:
    require_root("Slurm daemons, munged as user munge, network namespaces")
    module = slurm_cluster
    require_tools(*module.TOOLS, "shellcheck")
    root = Path(tempfile.mkdtemp(prefix="ddpkit-slurm-"))
    cluster = module.SlurmCluster(root, nodes_count=2)
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


def in_cluster(cluster: Any, *argv: str, cwd: Path, timeout: float = 240,
               **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ddpkit ARGV`` as a client of the cluster (in the controller node's namespace)."""
    return subprocess.run([*cluster.client_prefix(), sys.executable, "-m", "ddpkit", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=ddpkit_env(SLURM_CONF=str(cluster.conf), **env))


def healing_cluster(prefix: str) -> Iterator[Any]:
    """A three-node cluster of a heal test module's own (``yield from`` it in a module fixture): its drills leave
    nodes stopped or cut off for a while, which no other module should meet."""
    require_root("Slurm daemons, munged as user munge, network namespaces")
    require_tools(*slurm_cluster.TOOLS)
    cluster = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix=prefix)), nodes_count=3)
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


def uninterrupted_summary(where: Path, train: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """``train`` (``("train", ARGS...)``) on two local ranks, never interrupted: its summary (the loss history a
    healed job must equal)."""
    from tests.helpers import run_ddpkit

    res = run_ddpkit(train[0], "-n", "2", *train[1:], "--snapshot-path", str(where / "snap.pt"), "--json",
                     str(where / "summary.json"), timeout=timeout, env=ddpkit_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(json.loads((where / "summary.json").read_text()))


def job_log(cwd: Path) -> str:
    """Every line of the job's Slurm log(s) under ``cwd/logs``."""
    return "\n".join(p.read_text(errors="replace") for p in sorted((cwd / "logs").glob("*.out")))


def job_ledger(cwd: Path) -> list[Any]:
    """The records of the one heal run under ``cwd/.ddpkit-runs``."""
    from ddpkit.rundir.ledger import Ledger

    (run,) = list((cwd / ".ddpkit-runs").glob("slurm-*"))
    return Ledger(run).records()
