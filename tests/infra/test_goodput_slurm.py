"""The goodput ledger under a real Slurm job: rank 0 of ``ddpkit train --run-dir`` asks ``scontrol show job`` once
for the job's SubmitTime and StartTime, the ledger holds them as the queue wait, and the report accounts it before
the run's start (the namespace Slurm cluster of tests/infra/slurm_fixture.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.goodput.accounting import Category
from ddpkit.goodput.records import QueueWaited, read_goodput
from ddpkit.reports.run import load_run
from tests.infra.slurm_fixture import in_cluster, slurm_cluster_fixture  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
ROOT = Path(__file__).resolve().parents[2]
VENV = str(ROOT / ".venv") if (ROOT / ".venv").exists() else str(Path(sys.executable).parents[1])


def test_a_slurm_jobs_ledger_holds_its_queue_wait_as_slurm_recorded_it(slurm_cluster: Any, tmp_path: Path) -> None:
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "1x2", "--venv", VENV, "--no-exclusive",
                     "--", "train", "--run-dir", str(tmp_path / "run"), "--epochs", "1", cwd=tmp_path, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    job = re.findall(r"^(\d+)$", res.stdout, re.M)[0]
    queued = [r for r in read_goodput(tmp_path / "run") if isinstance(r, QueueWaited)]
    assert len(queued) == 1, (tmp_path / "run" / "goodput.jsonl").read_text()
    q = queued[0]
    assert (q.scheduler, q.job_id) == ("slurm", job)
    assert 0 <= q.start - q.submit < 180  # Slurm's whole seconds: a job started at once waited 0 s
    split = load_run(tmp_path / "run").split
    assert split.queue == q and split.start == pytest.approx(min(q.submit, split.start))
    assert split.seconds[Category.QUEUE_WAIT] == pytest.approx(q.start - q.submit, abs=1.0)
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
