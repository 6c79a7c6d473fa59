"""Test helpers, imported by test modules (fixtures live in conftest.py files): run the real CLI in subprocesses;
gate infrastructure tests honestly; compare a healed run with an uninterrupted one; the openings of the little
scripts that tests write to disk."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
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


def wait_until(ready: Callable[[], object], proc: subprocess.Popen[Any], log: Path, timeout: float = 120,
               poll: float = 0.1) -> None:
    """Poll ``ready()`` until it is true; fail with ``log``'s text if ``proc`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(poll)


@contextmanager
def killed_if_left(proc: subprocess.Popen[Any]) -> Iterator[subprocess.Popen[Any]]:
    """``proc``, killed on the way out if still running: a failed wait leaves no job behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


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


def uninterrupted_train(where: Path, *args: str, timeout: float, summary: bool = True) -> dict[str, Any]:
    """``ddpkit train -n 2 ARGS`` on this machine, never interrupted, its snapshots in ``where`` (made here): the run
    a healed one must equal bitwise. Returns its summary (``--json`` in ``where``), or {} without ``summary``."""
    where.mkdir(exist_ok=True)
    kept = ("--json", str(where / "summary.json")) if summary else ()
    done = run_ddpkit("train", "-n", "2", *args, "--snapshot-path", str(where / "snap.pt"), *kept,
                      env=ddpkit_env(OMP_NUM_THREADS="1"), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads((where / "summary.json").read_text())) if summary else {}


def assert_same_newest_model(ours: Path, theirs: Path) -> None:
    """The newest ``snap.*.pt`` in each directory: of the same step, its model bitwise equal (same keys)."""
    import torch

    from ddpkit.train.snapshot import SnapshotDir, read_snapshot

    mine = max(SnapshotDir(ours, "snap", ".pt", keep=1).candidates())
    other = max(SnapshotDir(theirs, "snap", ".pt", keep=1).candidates())
    assert mine[0] == other[0]
    a, b = read_snapshot(mine[1])[1]["model"], read_snapshot(other[1])[1]["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


# The little torch.distributed scripts that tests write to disk and run under ddpkit run, torchrun or a launcher:
# a script is its own imports, then one of these openings, then its own lines.

#: torch and gloo's process group
GLOO_OPENING = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
"""
#: gloo's process group, this rank and a hookless DDP model (DDP's C++ path) of one 16x16 layer
DDP_OPENING = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
"""
#: every rank all_reduces once, then raises the same ValueError("bad batch"): a job fault, no host to blame
RAISES_ON_EVERY_RANK = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
raise ValueError("bad batch")
"""


def raises_at_step(step: int, steps: int) -> str:
    """A script whose every rank all_reduces in a loop of ``steps`` and raises ValueError("bad batch at step STEP")
    at ``step``: a job fault, the same on every rank."""
    return GLOO_OPENING + f"""t = torch.ones(4)
for step in range({steps}):
    dist.all_reduce(t)
    if step == {step}:
        raise ValueError(f"bad batch at step {{step}}")
"""


@dataclass
class ChildProc:
    """A plain child process as the live agent's (or a member's) ``Proc``: ``live.agent.proc.Proc``."""

    popen: subprocess.Popen[bytes]
    host: str = "here"
    silent_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self) -> int | None:
        return self.popen.poll()

    def look(self) -> tuple[Any, int]:
        from ddpkit.live.agent.proc import Seen, stat_of

        state, ticks = stat_of(self.pid)
        return Seen.of_state(state), ticks

    def heard_since(self, since: float) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def close(self) -> None:
        self.popen.kill()
