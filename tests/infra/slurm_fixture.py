"""pytest fixture: a real Slurm cluster of two network-namespace nodes (scripts/slurm_cluster.py), one per session.

Import the fixture into a test module (``from tests.infra.slurm_fixture import slurm_cluster_fixture``; tests then ask
for ``slurm_cluster``). The cluster is started
once (about 3 s), torn down by PID at the end of the session (daemons, leftover job processes, namespaces),
even when tests fail.
"""

from __future__ import annotations

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
