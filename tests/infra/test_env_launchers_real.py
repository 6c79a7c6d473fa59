"""Launcher environments ddpkit must read as one world, on real infrastructure (issue 11): a Slurm heterogeneous
step, an sbatch script that exports RANK/LOCAL_RANK/WORLD_SIZE from Slurm's values, and PyTorchJob-elastic pods
(the operator's PET_* variables, no MASTER_ADDR) on two network-namespace hosts with ddpkit as the pod's agent.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ddpkit_env
from tests.infra.conftest import Etcd, Hosts
from tests.infra.slurm_fixture import slurm_cluster_fixture  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
CHECK = [sys.executable, "-m", "ddpkit", "check", "--timeout", "60"]


def _client(cluster: Any, argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cluster.client_prefix(), *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=ddpkit_env(SLURM_CONF=str(cluster.conf)))


def test_slurm_het_step_is_one_world(slurm_cluster: Any, tmp_path: Path) -> None:
    """srun ... : ... across two het components (1 task on node1, 2 on node2): one world of 3 that passes check."""
    res = _client(slurm_cluster, ["salloc", "-N1", "-n1", ":", "-N1", "-n2",
                                  "srun", "-N1", "-n1", ":", "-N1", "-n2", *CHECK], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verdict: PASS: 3 rank(s) on 2 host(s)" in res.stdout, res.stdout + res.stderr


def test_sbatch_exporting_torch_variables_from_slurm_passes_check(slurm_cluster: Any, tmp_path: Path) -> None:
    """The site-tutorial pattern: WORLD_SIZE from SLURM_NTASKS before srun, RANK/LOCAL_RANK from the task's own
    values; they agree with Slurm's, so it is Slurm's world (it used to be refused as torchrun)."""
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "export WORLD_SIZE=$SLURM_NTASKS\n"
        f"srun bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID; exec {' '.join(CHECK)}'\n")
    res = _client(slurm_cluster, ["sbatch", "--parsable", "-N2", "-n2", "-o", str(tmp_path / "job.out"),
                                  str(script)], tmp_path)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while _client(slurm_cluster, ["squeue", "-h", "-j", job], tmp_path).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still running after 240 s"
        time.sleep(0.5)
    log = (tmp_path / "job.out").read_text()
    assert "verdict: PASS: 2 rank(s) on 2 host(s)" in log, log
    assert "refused" not in log and "disagrees" not in log, log


def test_pytorchjob_elastic_pods_with_ddpkit_as_agent(two_hosts: Hosts, etcd: Etcd) -> None:
    """Each 'pod' gets what training-operator 1.9's elastic.go sets: PET_NNODES=MIN:MAX, PET_RDZV_ENDPOINT,
    PET_RDZV_BACKEND, PET_NPROC_PER_NODE, PET_RDZV_ID, and no MASTER_ADDR; ddpkit check is the pod's command."""
    pet = {"PET_NNODES": "2:2", "PET_NPROC_PER_NODE": "1", "PET_RDZV_BACKEND": "etcd-v2",
           "PET_RDZV_ENDPOINT": etcd.endpoint, "PET_RDZV_ID": f"pytorchjob-{two_hosts.cluster.run_id}",
           "PET_MAX_RESTARTS": "0", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    runs = [two_hosts.ddpkit(host, "check", "--timeout", "60", **pet) for host in two_hosts.hosts]
    for run in runs:
        run.wait(240)
    assert [run.returncode for run in runs] == [0, 0], "\n".join(run.output() for run in runs)
    verdicts = [run.stdout for run in runs if "verdict:" in run.stdout]
    assert len(verdicts) >= 1 and all("verdict: PASS: 2 rank(s) on 2 host(s)" in v for v in verdicts), \
        "\n".join(run.output() for run in runs)
