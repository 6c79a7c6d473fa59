"""ddpkit submit / status / logs on a real Slurm cluster: two nodes, each its own network namespace and IP.

One cluster per session (tests/infra/slurm_fixture.py); the job command is ``check`` / ``train`` where those
commands exist, else ``env --connect`` (starts the process group and verifies an all_reduce across the world).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.infra.slurm_fixture import in_cluster, slurm_cluster_fixture  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
ROOT = Path(__file__).resolve().parents[2]
VENV = str(ROOT / ".venv") if (ROOT / ".venv").exists() else str(Path(sys.executable).parents[1])
CONNECT = ["env", "--connect", "--json", "--timeout", "90"]


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"launcher"' in line]


def _job_id(res: subprocess.CompletedProcess[str]) -> str:
    ids = re.findall(r"^(\d+)$", res.stdout, re.M)
    assert ids, f"no job id printed: {res.stdout}\n{res.stderr}"
    return ids[0]


def test_wait_one_node_two_ranks_then_status_and_logs(slurm_cluster: Any, tmp_path: Path) -> None:
    cmd = ["check"]
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "1x2", "--venv", VENV, "--no-exclusive",
                     "--", *cmd, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    job = _job_id(res)
    assert f"job {job} COMPLETED exit code 0" in res.stderr
    log = next((tmp_path / "logs").glob(f"*_{job}.out")).read_text()
    assert f"ddpkit: job {job} on node1, rendezvous node1:" in log
    assert "verdict: PASS: 2 rank(s) on 1 host(s)" in log

    status = in_cluster(slurm_cluster, "status", job, "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    record = json.loads(status.stdout)
    assert (record["state"], record["exit_code"], record["nodes"]) == ("COMPLETED", 0, "node1")
    assert record["log"] == str(tmp_path / "logs" / f"ddpkit-{cmd[0]}_{job}.out")
    logs = in_cluster(slurm_cluster, "logs", job, cwd=tmp_path)
    assert logs.returncode == 0 and logs.stdout == log
    unknown = in_cluster(slurm_cluster, "status", "999999", cwd=tmp_path)
    assert unknown.returncode == 2 and "knows no job 999999" in unknown.stderr


def test_a_venv_not_on_path_runs_the_job_with_its_own_python(slurm_cluster: Any, tmp_path: Path) -> None:
    """Issue 18: ``.venv/bin/ddpkit submit slurm --wait`` with the venv NOT on PATH (a new user's first try). The
    job once called ``torchrun`` by name and failed on both nodes; it runs the submitting Python by path now."""
    from tests.helpers import ddpkit_env

    venv_bin = str(Path(VENV) / "bin")
    env = ddpkit_env(SLURM_CONF=str(slurm_cluster.conf))
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if p and Path(p).resolve() != Path(venv_bin))
    env.pop("VIRTUAL_ENV", None)
    assert not any((Path(p) / "torchrun").exists() for p in env["PATH"].split(":")), "torchrun is on PATH anyway"
    ddpkit = str(Path(venv_bin) / "ddpkit")
    res = subprocess.run([*slurm_cluster.client_prefix(), ddpkit, "submit", "slurm", "--wait", "-j", "2x2", "-o",
                          "job.sbatch", "--", "check"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    job = _job_id(res)
    assert f"job {job} COMPLETED exit code 0" in res.stderr
    assert "None" not in res.stderr, res.stderr  # once: "ddpkit: job 5 RUNNING None"
    script = (tmp_path / "job.sbatch").read_text()
    assert f"# Python: {Path(VENV) / 'bin' / 'python'}, the interpreter that ran ddpkit submit" in script, script
    log = next((tmp_path / "logs").glob(f"*_{job}.out")).read_text()
    assert "verdict: PASS: 4 rank(s) on 2 host(s)" in log, log
    status = in_cluster(slurm_cluster, "status", job, cwd=tmp_path)
    assert status.returncode == 0 and "None" not in status.stdout, status.stdout


def test_wait_returns_the_jobs_exit_code(slurm_cluster: Any, tmp_path: Path) -> None:
    script = tmp_path / "fail seven.py"
    script.write_text("import sys\nprint('failing on purpose', flush=True)\nsys.exit(7)\n")
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "1x1", "--tasks-per-rank", "--venv", VENV,
                     "--no-exclusive", "--", str(script), cwd=tmp_path)
    assert res.returncode == 7, res.stdout + res.stderr
    job = _job_id(res)
    status = json.loads(in_cluster(slurm_cluster, "status", job, "--json", cwd=tmp_path).stdout)
    assert (status["state"], status["exit_code"]) == ("FAILED", 7)
    assert "failing on purpose" in in_cluster(slurm_cluster, "logs", job, cwd=tmp_path).stdout


def test_two_nodes_rendezvous_on_the_first_node(slurm_cluster: Any, tmp_path: Path) -> None:
    """2 nodes x 2 ranks, one torchrun agent per node, running check; then one task per rank (ddpkit's own Slurm
    detection) running a short train, and `ddpkit env --connect` as srun tasks (rank discovery from Slurm)."""
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "2x2", "--venv", VENV, "--", "check",
                     cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    log = in_cluster(slurm_cluster, "logs", _job_id(res), cwd=tmp_path).stdout
    assert re.search(r"on node\[1-2\], rendezvous node1:\d+", log), log
    assert "verdict: PASS: 4 rank(s) on 2 host(s)" in log, log
    assert re.search(r"route-to-master +master node1:\d+", log), log

    # a short train across both nodes, one srun task per rank (ddpkit reads Slurm's variables)
    snap = tmp_path / "snap shots"
    snap.mkdir()
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "2x1", "--tasks-per-rank", "--venv",
                     VENV, "--", "train", "--epochs", "3", "--snapshot-path", f"{snap}/", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    log = in_cluster(slurm_cluster, "logs", _job_id(res), cwd=tmp_path).stdout
    assert "on node[1-2], one task per rank" in log
    assert "[RANK 0] Epoch 2" in log and "[RANK 1] Epoch 2" in log, log
    final, first = map(float, re.search(r"loss ([\d.]+) \(epoch 0: ([\d.]+)\)", log).groups())  # type: ignore[union-attr]
    assert final < first

    # srun ddpkit env --connect: every task finds its rank, node and master from Slurm's variables alone
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "2x1", "--tasks-per-rank", "--venv", VENV,
                     "--", *CONNECT, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    ranks = _json_lines(in_cluster(slurm_cluster, "logs", _job_id(res), cwd=tmp_path).stdout)
    assert sorted((r["rank"], r["node_rank"]) for r in ranks) == [(0, 0), (1, 1)]
    assert {r["launcher"] for r in ranks} == {"slurm"} and {r["master_addr"] for r in ranks} == {"node1"}
    assert all(r["connect"]["all_reduce_ok"] for r in ranks)


def _wait_for(cluster: Any, job: str, text: str, log: Path, timeout: float = 180, after: str = "") -> str:
    """Wait until ``text`` appears in the job's log (after the first ``after``, when given)."""
    deadline = time.monotonic() + timeout
    content = ""
    while time.monotonic() < deadline:
        content = log.read_text() if log.exists() else ""
        if after in content and text in content[content.index(after):]:
            return content
        time.sleep(0.5)
    state = cluster.client("scontrol", "show", "job", job).stdout
    raise AssertionError(f"{text!r} not in the log of job {job} within {timeout} s:\n{content}\n{state}")


def _start_requeued_now(cluster: Any, job: str) -> None:
    """Lift Slurm's begin-time delay for requeued jobs (about 2 minutes) so the requeued run starts now."""
    deadline = time.monotonic() + 60
    while "PENDING" not in cluster.client("squeue", "-h", "-j", job, "-o", "%T").stdout:
        assert time.monotonic() < deadline, "requeued job never went back to PENDING"
        time.sleep(0.5)
    assert cluster.client("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0


def _assert_each_resume_loads_the_last_snapshot(text: str, resumes: int) -> None:
    loads = list(re.finditer(r"^Loading snapshot (.+)$", text, re.M))
    assert len(loads) == resumes, text
    for load in loads:
        saved = re.findall(r"Training snapshot saved at (.+)$", text[:load.start()], re.M)
        assert saved and saved[-1] == load[1], (saved[-1:], load[1])
    assert len(re.findall(r"^Resuming training from snapshot at Epoch \d+", text, re.M)) == resumes


def test_preemption_resumes_train_from_its_snapshot(slurm_cluster: Any, tmp_path: Path) -> None:
    """A running train job (1 node x 2 ranks under torchrun): ``scontrol requeue`` (SIGTERM), then the ``--signal
    USR1`` path (train --preempt-signal USR1 --requeue requeues the job itself); each requeued run loads the
    snapshot the previous run wrote last, and the job completes."""
    snap = tmp_path / "snap shots"
    snap.mkdir()
    # 16384 samples: 256 steps per epoch, so the 10 epochs left after a signal take seconds (the default 32 steps
    # per epoch can finish before the signal arrives)
    res = in_cluster(slurm_cluster, "submit", "slurm", "-j", "1x2", "--requeue", "--signal", "USR1@60", "--venv",
                     VENV, "--no-exclusive", "--", "train", "--epochs", "12", "--samples", "16384",
                     "--snapshot-path", f"{snap}/", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = _job_id(res)
    log = tmp_path / "logs" / f"ddpkit-train_{job}.out"
    _wait_for(slurm_cluster, job, "Training snapshot saved", log)
    assert slurm_cluster.client("scontrol", "requeue", job).returncode == 0
    _start_requeued_now(slurm_cluster, job)
    _wait_for(slurm_cluster, job, "Training snapshot saved", log, after="restart 1")
    assert slurm_cluster.client("scancel", "--signal=USR1", job).returncode == 0
    _start_requeued_now(slurm_cluster, job)
    follow = in_cluster(slurm_cluster, "logs", job, "-f", cwd=tmp_path, timeout=300)
    text = follow.stdout
    assert "restart 2" in text and "SIGUSR1" in text, text
    assert "is deprecated" not in text, text  # no warning spam from the gradient hook
    _assert_each_resume_loads_the_last_snapshot(text, resumes=2)
    status = json.loads(in_cluster(slurm_cluster, "status", job, "--json", cwd=tmp_path).stdout)
    assert (status["state"], status["exit_code"], status["restarts"]) == ("COMPLETED", 0, 2), text


def test_bad_input_submits_nothing(slurm_cluster: Any, tmp_path: Path) -> None:
    def job_count() -> int:
        return len(slurm_cluster.client("squeue", "-h", "-t", "all", "-o", "%i").stdout.split())

    before = job_count()
    # every refusal is covered in tests/unit/test_jobs_render.py; here: a few, against a live scheduler
    for bad in (["-j", "2x", "--", "check"], ["-j", "1x2", "--slurm-output", "my logs/%j.out", "--", "check"],
                ["-j", "1x2", "--venv", "/a", "--conda-env", "b", "--", "check"]):
        res = in_cluster(slurm_cluster, "submit", "slurm", *bad, cwd=tmp_path)
        assert res.returncode == 2, (bad, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and "Fix:" in res.stderr and res.stdout == ""
    res = in_cluster(slurm_cluster, "submit", "lsf", "-j", "1x2", "--", "check", cwd=tmp_path)
    assert res.returncode == 2 and "backend 'lsf' is unknown" in res.stderr
    assert job_count() == before
    assert not (tmp_path / "logs").exists()
