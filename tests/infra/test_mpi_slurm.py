"""train --grad-transport mpi and check under ``srun --mpi=pmix`` on a real two-node Slurm cluster.

Slurm's PMIx plugin makes the srun tasks one MPI world (Open MPI's library joins it directly, no mpirun); ddpkit
reads its torch world from Slurm's variables and checks the two agree before the process group starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ddpkit_env
from tests.infra.slurm_fixture import in_cluster, slurm_cluster_fixture  # noqa: F401 (the fixture)
from tests.infra.test_jobs_slurm import VENV, _job_id

pytestmark = pytest.mark.infra


def _srun(cluster: Any, mpi: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # no --kill-on-bad-exit: a refusal is every task's own exit 2, not a task killed after the first one's
    return subprocess.run([*cluster.client_prefix(), "srun", "-N", "2", "-n", "2", f"--mpi={mpi}",
                           sys.executable, "-m", "ddpkit", *argv], capture_output=True,
                          text=True, timeout=300,
                          cwd=cwd, env=ddpkit_env(SLURM_CONF=str(cluster.conf)))


def test_srun_pmix_trains_through_mpi_and_check_verifies_it(slurm_cluster: Any, tmp_path: Path) -> None:
    # ddpkit's own Slurm script: --tasks-per-rank and a command asking for MPI render srun --mpi=pmix
    summary = tmp_path / "summary.json"
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "2x1", "--tasks-per-rank", "--venv", VENV,
                     "--no-exclusive", "-o", str(tmp_path / "job.sbatch"), "--", "train", "--samples", "512",
                     "--epochs", "2", "--grad-transport", "mpi", "--json", str(summary), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    log = in_cluster(slurm_cluster, "logs", _job_id(res), cwd=tmp_path).stdout
    assert "--mpi=pmix" in (tmp_path / "job.sbatch").read_text()
    assert "[RANK 1] Epoch 1" in log and "gradients averaged through MPI (Open MPI" in log, log
    result = json.loads(summary.read_text())
    assert result["grad_transport"] == "mpi" and result["world_size"] == 2 and result["global_step"] == 16

    check = _srun(slurm_cluster, "pmix", "check", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr[-3000:]
    line = next(x for x in check.stdout.splitlines() if "ddp-sync" in x)
    assert "PASS" in line and "identical on 2 ranks" in line and "gradients averaged through MPI" in line


def test_srun_without_pmix_is_refused(slurm_cluster: Any, tmp_path: Path) -> None:
    done = _srun(slurm_cluster, "none", "train", "--grad-transport", "mpi", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert done.stderr.count("not started by an MPI launcher") == 2 and "srun --mpi=pmix" in done.stderr
    assert "Traceback" not in done.stderr
