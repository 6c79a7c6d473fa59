"""ddpkit's CUDA/NCCL paths on a real GPU: NCCL process groups, CUDA events in bench, GPU tensors in snapshots
and resume, and two ranks refused on one GPU by name. Where no GPU is visible these tests skip and say so: they
run on a GPU machine through ``scripts/gpu_check.sh run`` (docs/gpu.md records what they saw)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.train.snapshot import read_snapshot
from tests.helpers import newest_snapshot, run_ddpkit, run_torchrun_worker, same_state

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device visible to this torch: the gpu tests run on a GPU machine "
                              "(scripts/gpu_check.sh run, see docs/gpu.md)"),
]

HERE = Path(__file__).resolve().parent
# --width 512: 0.5M parameters, large enough that cuBLAS runs real kernels, small enough for seconds of training
JOB = ("--model", "mlp", "--width", "512", "--samples", "1024", "--epochs", "4", "--seed", "3", "--deterministic")


def _uuid() -> str:
    return str(torch.cuda.get_device_properties(0).uuid)


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_env_connect_starts_an_nccl_group() -> None:
    done = run_ddpkit("env", "--connect", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nccl" in done.stdout and "cuda:0" in done.stdout


def test_check_one_rank_passes_on_nccl_and_names_the_gpu(tmp_path: Path) -> None:
    done = run_ddpkit("check", "-n", "1", "--json", str(tmp_path / "check.json"), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = _json(tmp_path / "check.json")
    assert report["passed"] and report["backend"] == "nccl" and report["device"] == "cuda:0"
    (rank,) = report["ranks"]
    assert rank["device"] == "cuda:0" and rank["gpu_uuid"] == _uuid()
    assert f"cuda x1 ({_uuid()[:8]})" in done.stdout  # the roll-call's node row names the GPU
    assert {c["name"] for c in report["checks"] if c["status"] == "PASS"} >= {"all_reduce_sum", "ddp-sync"}


def test_bench_one_rank_times_with_cuda_events_and_verifies(tmp_path: Path) -> None:
    done = run_ddpkit("bench", "-n", "1", "-b", "1K", "-e", "64M", "-f", "8", "--json", str(tmp_path / "bench.json"),
                      timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = _json(tmp_path / "bench.json")
    assert report["backend"] == "nccl" and report["device"] == "cuda" and report["timer"] == "cuda-events"
    assert "timer cuda-events" in done.stdout and _uuid() in done.stdout
    # torch's all_reduce has no out-of-place form: that column is None there
    cells = [row[k] for op in report["ops"] if op["supported"] for row in op["rows"] for k in ("out_of_place",
                                                                                                "in_place") if row[k]]
    assert len(cells) >= 40 and all(c["wrong"] == 0 and c["time_us"] > 0 for c in cells)


def _train(directory: Path, *extra: str) -> tuple[int, str, dict[str, Any] | None]:
    directory.mkdir(parents=True, exist_ok=True)
    done = run_ddpkit("train", *JOB, "--snapshot-path", str(directory / "snap.pt"), "--keep", "4", "--json",
                      str(directory / "summary.json"), *extra, timeout=300)
    summary = _json(directory / "summary.json") if (directory / "summary.json").exists() else None
    return done.returncode, done.stdout + done.stderr, summary


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("baseline")
    code, out, summary = _train(tmp)
    assert code == 0, out
    assert summary is not None and summary["device"] == "cuda:0" and summary["backend"] == "nccl"
    return tmp


def test_train_on_cuda_learns_and_snapshots_gpu_tensors(baseline: Path) -> None:
    summary = _json(baseline / "summary.json")
    assert summary["final_loss"] < summary["first_loss"]
    header, state = newest_snapshot(baseline)
    assert header["next_epoch"] == 4
    assert "cuda" in state["rng"][0]  # the CUDA generator's state is saved with the CPU one


def test_preempted_cuda_run_resumes_bitwise_equal(baseline: Path, tmp_path: Path) -> None:
    code, out, summary = _train(tmp_path, "--drill", "preempt@epoch=2")
    assert code == 75, out
    assert summary is not None and summary["preempted"]
    code, out, _ = _train(tmp_path, "--drill", "preempt@epoch=2")
    assert code == 0, out
    assert "Resuming training from snapshot at Epoch 2" in out
    assert same_state(newest_snapshot(tmp_path)[1], newest_snapshot(baseline)[1],
                      ("model", "optimizer", "rng", "loss_history"))


def test_async_snapshots_of_cuda_tensors_hold_what_sync_ones_do(baseline: Path, tmp_path: Path) -> None:
    code, out, summary = _train(tmp_path, "--async-snapshot")
    assert code == 0, out
    assert summary is not None and len(summary["snapshot_stall_s"]) == 4
    for step in (32, 64, 96, 128):  # 1024 samples / batch 32 = 32 steps an epoch
        name = f"snap.{step:09d}.pt"
        assert same_state(read_snapshot(tmp_path / name)[1], read_snapshot(baseline / name)[1],
                          ("model", "optimizer", "loss_history"))


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs a node with one GPU for two ranks to share it")
@pytest.mark.parametrize("command", ["train", "check", "bench"])
def test_two_ranks_on_one_gpu_are_named_and_refused(command: str, tmp_path: Path) -> None:
    extra = ("--snapshot-path", str(tmp_path / "snap.pt")) if command == "train" else ()
    done = run_ddpkit(command, "-n", "2", *extra, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"ranks 0 and 1 share GPU {_uuid()}" in out
    assert "Traceback" not in out and not list(tmp_path.glob("snap*"))


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs a node with one GPU for two ranks to share it")
def test_two_ranks_on_one_gpu_run_on_gloo_when_asked(tmp_path: Path) -> None:
    done = run_ddpkit("train", "-n", "2", "--backend", "gloo", "--samples", "256", "--epochs", "2", "--json",
                      str(tmp_path / "summary.json"), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _json(tmp_path / "summary.json")["backend"] == "gloo"


def test_gloo_carries_cuda_tensors_between_ranks_on_one_gpu() -> None:
    result = run_torchrun_worker(HERE.parent / "workers" / "gloo_cuda_tensors.py", 2)
    print(json.dumps(result))
    assert result["ops"]["all_reduce"] == "ok" and result["ops"]["broadcast"] == "ok"


def test_the_watch_follows_an_nccl_ddp_job_on_the_gpu(tmp_path: Path) -> None:
    """The watch (issue 27) under ``ddpkit run`` on a user's NCCL job: every DDP step on the GPU is counted and timed
    (the per-rank summary), no hang is reported on a healthy job, and the job's exit code is its own."""
    events = tmp_path / "watch.jsonl"
    done = run_ddpkit("run", "-n", "1", "--events", str(events), "--", str(HERE.parent / "workers" /
                                                                            "watch_device_job.py"), "60", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT backend=nccl device=cuda:0 steps=60" in done.stdout, done.stdout
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["event"] for r in records] == ["summary"], records
    rank = records[0]["ranks"]["0"]
    assert rank["steps"] == 60 and rank["step_p50_s"] > 0, rank
