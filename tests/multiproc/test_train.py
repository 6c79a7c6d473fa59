"""ddpkit train on real 2-rank gloo worlds started by ddpkit's local launcher (torch's elastic agent).

One uninterrupted baseline run; every fault scenario must end with parameters bitwise equal to it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.train.snapshot import SnapshotDir, read_header, read_snapshot
from tests.helpers import ddpkit_env, free_port, newest_snapshot, require_tools, run_ddpkit, same_state

pytestmark = pytest.mark.multiproc

# 512 samples / 2 ranks / batch 32 = 8 steps per epoch; 4 epochs.
JOB = ("--samples", "512", "--epochs", "4", "--seed", "7")
HERE = Path(__file__).resolve().parent


def _train(tmp: Path, *extra: str, timeout: float = 180, env: dict[str, str] | None = None) -> tuple[
        subprocess.CompletedProcess[str], dict[str, Any] | None]:
    tmp.mkdir(parents=True, exist_ok=True)
    done = run_ddpkit("train", "-n", "2", *JOB, "--snapshot-path", str(tmp / "snap.pt"), "--json",
                      str(tmp / "summary.json"), *extra, timeout=timeout, env=env)
    summary = json.loads((tmp / "summary.json").read_text()) if (tmp / "summary.json").exists() else None
    return done, summary


def _final(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    return newest_snapshot(tmp, "snap")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("baseline")
    done, summary = _train(tmp, "--keep", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary is not None
    (tmp / "stdout.txt").write_text(done.stdout)
    return tmp


def test_trains_and_only_rank_0_writes(baseline: Path) -> None:
    out = (baseline / "stdout.txt").read_text()
    summary = json.loads((baseline / "summary.json").read_text())
    for rank in (0, 1):
        for epoch in range(4):
            assert f"[RANK {rank}] Epoch {epoch} | Batchsize: 32 | Steps: 8" in out
    losses = summary["loss_history"]
    assert losses["3"] < losses["0"] and summary["final_loss"] == losses["3"]
    assert summary["world_size"] == 2 and summary["global_step"] == 32 and summary["snapshots_written"] == 4
    files = sorted(p.name for p in baseline.iterdir() if p.name.startswith("snap"))
    assert files == [f"snap.{s:09d}.pt" for s in (8, 16, 24, 32)]  # no temporary files left behind
    assert out.count("Training snapshot saved at") == 4
    writers = {read_header(baseline / f)["writer_rank"] for f in files}
    pids = {read_header(baseline / f)["writer_pid"] for f in files}
    assert writers == {0} and len(pids) == 1
    header, state = _final(baseline)
    assert header["next_epoch"] == 4 and len(state["rng"]) == 2  # both ranks' RNG states, gathered to rank 0
    assert header["versions"]["torch"] == torch.__version__ and header["config"]["seed"] == 7


def test_json_reports_the_phases_in_order(baseline: Path) -> None:
    """--json says where the time went, from the agent's start to the process group's end, so a start-up or exit
    regression shows in the numbers."""
    summary = json.loads((baseline / "summary.json").read_text())
    marks = [summary[f"{m}_at"] for m in ("launched", "worker", "job", "group", "loop", "first_step", "loop_end",
                                          "finished")]
    assert marks == sorted(marks)
    assert summary["startup_s"] == pytest.approx(summary["loop_at"] - summary["launched_at"])
    assert summary["teardown_s"] == pytest.approx(summary["finished_at"] - summary["loop_end_at"])
    phases = summary["phases_s"]
    assert list(phases) == ["launch", "build_job", "process_group", "resume_and_wrap", "first_step", "training",
                            "teardown"]
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(summary["finished_at"] - summary["launched_at"])
    # launched_at is the agent's start, before its workers existed: the launch phase is not empty
    assert phases["launch"] > 0


def test_killed_worker_restarts_and_resumes_bitwise_exact(baseline: Path, tmp_path: Path) -> None:
    done, summary = _train(tmp_path, "--max-restarts", "2", "--drill", "kill-worker@epoch=2,rank=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "killing rank 1" in done.stdout and "Resuming training from snapshot at Epoch 2" in done.stdout
    assert summary is not None and summary["restarts"] == 1 and summary["resumed_from"]["global_step"] == 16
    (drill,) = summary["drills"]
    assert drill["fired_at_step"] == 21 and drill["lost_steps"] == 5 and drill["within_interval"]
    assert same_state(_final(tmp_path)[1], _final(baseline)[1])


LAUNCHERS = {
    # Open MPI starts the two ranks; ddpkit reads OMPI_COMM_WORLD_* and needs no MASTER_* on one node
    "openmpi": (["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m", "ddpkit"], {}),
    # a Kubeflow PyTorchJob pod (nprocPerNode 2): ddpkit acts as the pod's agent and starts its ranks
    "kubeflow": ([sys.executable, "-m", "ddpkit"], {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0",
                                                    "PET_MASTER_ADDR": "127.0.0.1", "PET_RDZV_ID": "pytorchjob-uid"}),
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_other_launchers_train_the_same_job_bitwise(launcher: str, baseline: Path, tmp_path: Path) -> None:
    """The same job under mpirun and as a Kubeflow pod ends in the same state, bit for bit, as under ddpkit -n 2."""
    prefix, extra = LAUNCHERS[launcher]
    if launcher == "openmpi":
        require_tools("mpirun")
    env = ddpkit_env(**extra, **({"PET_MASTER_PORT": free_port()} if launcher == "kubeflow" else {}))
    done = subprocess.run([*prefix, "train", *JOB, "--keep", "4", "--snapshot-path", str(tmp_path / "snap.pt"),
                           "--json", str(tmp_path / "summary.json")], capture_output=True, text=True, timeout=180,
                          env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 32
    # Open MPI gives its ranks a pseudo-terminal even though this output is a pipe: still no progress bar
    assert "\x1b[" not in done.stdout and "[RANK 0] Epoch 3 | Batchsize: 32 | Steps: 8" in done.stdout
    # bitwise, RNG states included (importing rich for a bar after seeding once drew from Python's RNG)
    assert same_state(_final(tmp_path)[1], _final(baseline)[1], ("model", "optimizer", "rng", "loss_history"))


def test_corrupt_newest_snapshot_falls_back_to_the_previous(baseline: Path, tmp_path: Path) -> None:
    for step in (16, 24):
        shutil.copy(baseline / f"snap.{step:09d}.pt", tmp_path / f"snap.{step:09d}.pt")
    newest = tmp_path / "snap.000000024.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    done, summary = _train(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "snap.000000024.pt is unusable" in done.stdout and "checksum" in done.stdout
    assert "Resuming training from snapshot at Epoch 2" in done.stdout
    assert summary is not None and summary["resumed_from"]["global_step"] == 16
    assert same_state(_final(tmp_path)[1], _final(baseline)[1])


def test_preempt_drill_usr1_async_snapshot_then_rerun_resumes_exactly(baseline: Path, tmp_path: Path) -> None:
    args = ("--async-snapshot", "--preempt-signal", "USR1", "--drill", "preempt@epoch=2")
    done, summary = _train(tmp_path, *args)
    assert done.returncode == 75, done.stdout + done.stderr[-3000:]
    assert "received SIGUSR1" in done.stdout and summary is not None and summary["preempted"]
    assert "wrote a snapshot (exit 75): run the same command again to resume" in done.stderr
    assert "failed first" not in done.stderr  # a preemption is not reported as a failure
    assert "is deprecated" not in done.stderr  # the gradient hook's all-gather uses torch's current name
    # signalled after step 21: the flag rides with step 22's gradients, and every rank stops after step 22
    header, _ = read_snapshot(tmp_path / "snap.000000022.pt")
    assert (header["next_epoch"], header["next_batch"]) == (2, 6)
    # the async writer's epoch-1 snapshot holds exactly what the synchronous baseline wrote
    _, async_epoch1 = read_snapshot(tmp_path / "snap.000000016.pt")
    _, sync_epoch1 = read_snapshot(baseline / "snap.000000016.pt")
    assert same_state(async_epoch1, sync_epoch1, ("model", "optimizer", "rng", "loss_history"))

    again, summary = _train(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming training from snapshot at Epoch 2, step 6" in again.stdout
    assert "sending SIGUSR1" not in again.stdout  # the drill fired once, not again on the rerun
    # the loss history too: epoch 2's loss covers its 6 steps before the snapshot, as in the uninterrupted run
    assert same_state(_final(tmp_path)[1], _final(baseline)[1], ("model", "optimizer", "rng", "loss_history"))
    assert summary is not None and summary["loss_history"] == json.loads((baseline / "summary.json").read_text())[
        "loss_history"]


def test_sigterm_to_the_launcher_snapshots_exits_75_and_rerun_resumes(tmp_path: Path) -> None:
    snap = str(tmp_path / "snap.pt")
    # 264,193 parameters: above gradients.PYTHON_HOOK_MAX_PARAMS, so the flags travel in a vote every 4 steps
    model = ("--model", "mlp", "--width", "1024", "--depth", "1")
    cmd = [sys.executable, "-m", "ddpkit", "train", "-n", "2", "--samples", "512", "--epochs", "100000", *model,
           "--save-every", "1000", "--snapshot-path", snap, "--requeue", "--json", str(tmp_path / "summary.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ddpkit_env(),
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if "[RANK 0] Epoch 2 " in line or time.monotonic() > deadline:
                break
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75, rest[-3000:]
    assert "received SIGTERM" in rest and "Preempted at epoch" in rest
    assert "--requeue: not running under Slurm (SLURM_JOB_ID is unset): nothing requeued" in rest
    assert json.loads((tmp_path / "summary.json").read_text())["stop_flags"] == "vote every 4 steps"
    (step, path), = SnapshotDir(tmp_path, "snap", ".pt", keep=1).candidates()
    header = read_header(path)
    assert header["global_step"] == step and header["global_step"] >= 24
    done = run_ddpkit("train", "-n", "2", "--samples", "512", "--epochs", str(header["next_epoch"] + 1), *model,
                      "--save-every", "1000", "--snapshot-path", snap, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Resuming training from snapshot at Epoch {header['next_epoch']}" in done.stdout


def test_make_job_trains_a_user_model(tmp_path: Path) -> None:
    env = ddpkit_env(PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    done, summary = _train(tmp_path, "--make-job", "train_user_job:make_job", "--lr", "0.01", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary is not None and summary["job"] == "squares" and summary["parameters"] == 4 * 32 + 32 + 32 + 1
    assert summary["final_loss"] < summary["first_loss"] / 2
    _, state = _final(tmp_path)
    assert "exp_avg" in str(state["optimizer"]["state"][0].keys())  # Adam's state is saved, not only weights


def test_bad_input_exits_2_before_training(baseline: Path, tmp_path: Path) -> None:
    (tmp_path / "a file").write_text("")  # a missing directory is created; one that cannot be is refused
    cases = [("--save-every", "0"), ("--samples", "-5"), ("--snapshot-path", str(tmp_path / "a file" / "s.pt")),
             ("--make-job", "no_such_pkg_xyz.jobs:make_job"), ("--drill", "kill-worker@epoch=1")]
    for args in cases:
        done = run_ddpkit("train", "-n", "2", *args, timeout=120)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert "Traceback" not in done.stderr and "Epoch" not in done.stdout, args
    # a snapshot written by another job (here: another learning rate) is refused, on every rank
    done = run_ddpkit("train", "-n", "2", *JOB, "--lr", "0.5", "--snapshot-path", str(baseline / "snap.pt"),
                      timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "different job" in done.stderr and "lr: snapshot 0.001, this run 0.5" in done.stderr
    assert "Traceback" not in done.stderr and "Epoch" not in done.stdout


@pytest.mark.slow  # a minute or more
def test_preempted_after_an_epochs_last_step_keeps_that_epochs_loss(tmp_path: Path) -> None:
    """One step an epoch: the drill fires on an epoch's last step, so the preemption snapshot starts the next epoch
    and the stopped run must record the finished epoch's loss before it writes (it was lost from the history)."""
    job = ("--samples", "32", "--epochs", "3", "--seed", "5")

    def train(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return run_ddpkit("train", *job, "--snapshot-path", str(tmp_path / name / "snap.pt"), "--json",
                          str(tmp_path / f"{name}.json"), *extra, timeout=120)

    for name in ("whole", "cut"):
        (tmp_path / name).mkdir()
    assert train("whole").returncode == 0
    stopped = train("cut", "--drill", "preempt@epoch=1")
    assert stopped.returncode == 75, stopped.stdout + stopped.stderr
    header, _ = newest_snapshot(tmp_path / "cut")
    assert (header["next_epoch"], header["next_batch"]) == (2, 0)
    assert train("cut", "--drill", "preempt@epoch=1").returncode == 0
    history = [json.loads((tmp_path / f"{name}.json").read_text())["loss_history"] for name in ("whole", "cut")]
    assert history[1] == history[0] and len(history[0]) == 3


def test_under_heal_each_drill_is_told_with_its_own_resume(baseline: Path, tmp_path: Path) -> None:
    """Two killed workers under --heal: three attempts. Each drill's line names the resume that followed it (the
    first said the last attempt's resume step, 'lost 0 steps' and 'restarted 0 time(s)')."""
    done, summary = _train(tmp_path, "--heal", "--run-dir", str(tmp_path / "run"), "--drill",
                           "kill-worker@epoch=1,rank=1", "--drill", "kill-worker@epoch=3,rank=1", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary is not None and summary["restarts"] == 2, summary
    first, second = sorted(summary["drills"], key=lambda d: d["fired_at_step"])
    assert first["resumed_at_step"] < first["fired_at_step"] < second["resumed_at_step"] < second["fired_at_step"]
    for d in (first, second):
        assert d["lost_steps"] == d["fired_at_step"] - d["resumed_at_step"] > 0 and d["within_interval"], d
    assert f"resumed at step {first['resumed_at_step']}; lost {first['lost_steps']} steps" in done.stdout
    assert same_state(_final(tmp_path)[1], _final(baseline)[1])
