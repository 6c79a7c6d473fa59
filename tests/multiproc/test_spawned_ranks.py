"""Ranks started afresh instead of forked from the agent: always so with a CUDA build of torch (a forked child
cannot use CUDA once the agent touched the driver, docs/gpu.md), here on CPU through DDPKIT_START_METHOD=spawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import ddpkit_env, run_ddpkit

pytestmark = pytest.mark.multiproc


def test_check_passes_with_spawned_ranks(tmp_path: Path) -> None:
    done = run_ddpkit("check", "-n", "2", "--json", str(tmp_path / "check.json"), timeout=180,
                      env=ddpkit_env(DDPKIT_START_METHOD="spawn"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["passed"] and len({r["pid"] for r in report["ranks"]}) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (--backend nccl must be refused)")
def test_a_spawned_rank_failure_is_said_once_without_torch_noise() -> None:
    done = run_ddpkit("train", "-n", "2", "--backend", "nccl", timeout=180, env=ddpkit_env(DDPKIT_START_METHOD="spawn"))
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "backend nccl was asked for but no CUDA device is visible" in out and "failed first with exit code 2" in out
    # torch's own lines say the same thing again, with its timestamps: root_cause says it once
    assert "failed (exitcode" not in out and "closing signal" not in out and "Traceback" not in out
