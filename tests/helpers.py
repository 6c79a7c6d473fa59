"""Test helpers, imported by test modules (fixtures live in conftest.py files): run the real CLI in subprocesses;
gate infrastructure tests honestly."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
IS_ROOT = os.geteuid() == 0


def ddpkit_env(**extra: str) -> dict[str, str]:
    """A clean environment for a ddpkit subprocess: no launcher variables leaking in from the test runner."""
    # and what a heal supervisor tells its ranks: a unit test that runs one in the test process (``supervise``) sets
    # them there, and every later subprocess of that pytest worker inherited them (a job's goodput lines went to that
    # test's run directory)
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "DDPKIT_LAUNCHED", "DDPKIT_FAULTS", "DDPKIT_RUN_DIR",
            "DDPKIT_ATTEMPT", "DDPKIT_HEAL_SILENT_S")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "PET_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_ddpkit(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
               cwd: str | Path | None = None, errors: str = "strict") -> subprocess.CompletedProcess[str]:
    """Run ``python -m ddpkit ARGS`` to completion (or fail the test at ``timeout``). ``errors``: how to decode
    bytes that are not UTF-8 (``replace`` where a launcher relays the output, see test_jobs_local)."""
    return subprocess.run([sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True, errors=errors,
                          timeout=timeout, env=env or ddpkit_env(), cwd=cwd)


def free_port() -> str:
    """A free TCP port on 127.0.0.1: other test runs may share this machine, so never a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_torchrun_worker(worker: Path, nproc: int, timeout: float = 180) -> dict[str, Any]:
    """Run a tests/workers script under real torchrun with ``nproc`` ranks; return rank 0's ``RESULT {json}`` line."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(worker)], capture_output=True, text=True, timeout=timeout, env=ddpkit_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout + proc.stderr
    return dict(json.loads(line[len("RESULT "):]))


def require_tools(*tools: str) -> None:
    """Infrastructure gate: skip only on a non-root machine without the tools; as root (CI) a missing tool fails."""
    missing = [t for t in tools if shutil.which(t) is None]
    if not missing:
        return
    if IS_ROOT:
        pytest.fail(f"infrastructure missing as root: {', '.join(missing)} (make test installs the Debian packages; "
                    "did 'make infra-deps' fail?)")
    pytest.skip(f"not root and {', '.join(missing)} not installed: infrastructure test cannot run here")


def require_root(reason: str) -> None:
    if not IS_ROOT:
        pytest.skip(f"needs root ({reason})")


def newest_snapshot(directory: Path, prefix: str = "snap") -> tuple[Any, dict[str, Any]]:
    """The newest valid snapshot ``PREFIX*.pt`` in ``directory``: (header, state)."""
    from ddpkit.train.snapshot import SnapshotDir, read_snapshot

    (_, newest), *_ = SnapshotDir(directory, prefix, ".pt", keep=1).candidates()
    return read_snapshot(newest)


def same_state(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...] = ("model", "optimizer", "rng")) -> bool:
    """Two training states bitwise equal in ``keys`` (tensors by dtype and value, containers element by element)."""
    import torch

    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(equal(p, q) for p, q in zip(x, y, strict=True))
        return bool(x == y)

    return all(equal(a[k], b[k]) for k in keys)


def gloo_status(check: str) -> str:
    """The status a gloo check of this torch earns: gloo's all_to_all arrived in torch 2.12 (pytorch/pytorch#165435,
    merged 2026-04-01); before it ddpkit's check says SKIP, "not supported by gloo" (seen with torch 2.11 on the GPU
    machine, docs/gpu.md). Everything else must PASS."""
    import torch

    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return "SKIP" if check == "all_to_all" and version < (2, 12) else "PASS"
