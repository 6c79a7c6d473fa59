"""Issue 28 on a real Slurm cluster of three namespace nodes: a fault on one node (its interface's MTU changed);
`check` inside the job names it; by default nothing is drained; `check --on-fail drain` drains exactly that node
with ddpkit's reason (`sinfo -R`); a job resubmitted with `--exclude-from` the report passes on the others and
changes nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scripts import slurm_cluster

from tests.helpers import require_root, require_tools
from tests.infra.slurm_fixture import in_cluster

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
ROOT = Path(__file__).resolve().parents[2]
VENV = str(ROOT / ".venv") if (ROOT / ".venv").exists() else str(Path(sys.executable).parents[1])
REASON = "ddpkit check: node-facts: nic.mtu 1400 (others 1500)"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """This module's own cluster: it drains a node, which no other test should meet."""
    require_root("Slurm daemons, munged as user munge, network namespaces")
    require_tools(*slurm_cluster.TOOLS)
    c = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix="ddpkit-slurm-drain-")), nodes_count=3)
    c.start(timeout=120)
    try:
        yield c
    finally:
        c.stop()


def _drained(c: Any) -> list[tuple[str, str]]:
    res = c.client("sinfo", "-R", "-h", "-o", "%N|%E")
    assert res.returncode == 0, res.stderr
    return sorted(tuple(line.split("|", 1)) for line in res.stdout.splitlines() if line.strip())  # type: ignore[misc]


def _check_job(c: Any, tmp: Path, name: str, *options: str, nodes: int = 3) -> tuple[int, dict[str, Any], str]:
    report = tmp / f"{name}.json"
    res = in_cluster(c, "submit", "slurm", "--wait", "-j", f"{nodes}x1", "--venv", VENV, "--no-exclusive",
                     "--name", name, *options, "--", "check", "--json", str(report), "--timeout", "60", cwd=tmp,
                     timeout=400)
    job = re.findall(r"^(\d+)$", res.stdout, re.M)
    assert job, res.stdout + res.stderr
    log = next((tmp / "logs").glob(f"*_{job[0]}.out")).read_text()
    assert report.exists(), log
    return res.returncode, json.loads(report.read_text()), log


def test_drain_inside_the_job_then_exclude_from_the_report(cluster: Any, tmp_path: Path) -> None:
    faulty = cluster.nodes[2]
    subprocess.run(["ip", "-n", faulty.netns, "link", "set", "dev", faulty.veth, "mtu", "1400"], check=True)

    code, report, log = _check_job(cluster, tmp_path, "printed")
    # the job fails (srun --kill-on-bad-exit ends the step when the first rank leaves with check's exit code 1)
    assert code != 0 and report["exit_code"] == 1, log
    assert report["bad_hosts"] == [{"host": faulty.name, "slurm_node": faulty.name,
                                    "reasons": ["node-facts: nic.mtu 1400 (others 1500)"]}], log
    assert f"scontrol update NodeName={faulty.name} State=DRAIN 'Reason={REASON}'" in log
    assert _drained(cluster) == []  # print, the default, changes nothing

    drain_report = tmp_path / "drain.json"
    res = in_cluster(cluster, "submit", "slurm", "--wait", "-j", "3x1", "--venv", VENV, "--no-exclusive", "--",
                     "check", "--on-fail", "drain", "--json", str(drain_report), "--timeout", "60", cwd=tmp_path,
                     timeout=400)
    assert res.returncode != 0 and json.loads(drain_report.read_text())["exit_code"] == 1, res.stdout + res.stderr
    assert _drained(cluster) == [(faulty.name, REASON)]

    code, report, log = _check_job(cluster, tmp_path, "excluded", "--exclude-from", str(drain_report), nodes=2)
    assert code == 0, log
    assert sorted(n["host"] for n in report["nodes"]) == [n.name for n in cluster.nodes[:2]]
    assert report["bad_hosts"] == []
    assert _drained(cluster) == [(faulty.name, REASON)]  # the second run changed nothing
