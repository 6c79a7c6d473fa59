"""pytest fixture: a real Slurm cluster of two network-namespace nodes (scripts/slurm_cluster.py), one per session.

Import the fixture into a test module (``from tests.infra.slurm_fixture import slurm_cluster_fixture``; tests then ask
for ``slurm_cluster``). The cluster is started
once (about 3 s), torn down by PID at the end of the session (daemons, leftover job processes, namespaces),
even when tests fail.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scripts import slurm_cluster

from tests.helpers import ddpkit_env, require_root, require_tools, uninterrupted_train

ROOT = Path(__file__).resolve().parents[2]
#: the virtual environment a job's nodes run ddpkit from (``--venv``): this checkout's, or the running Python's
VENV = str(ROOT / ".venv") if (ROOT / ".venv").exists() else str(Path(sys.executable).parents[1])
#: the heal drills' training: ~64 steps an epoch; 100 epochs run about 15 s on two ranks here: long enough for a
#: fault a few seconds in
HEAL_TRAIN = ("train", "--epochs", "100", "--samples", "4096")
HEAL_JOB_TIMEOUT = 300


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture() -> Iterator[Any]:
    require_root("Slurm daemons, munged as user munge, network namespaces")
    module = slurm_cluster
    require_tools(*module.TOOLS, "shellcheck")
    root = Path(tempfile.mkdtemp(prefix="ddpkit-slurm-"))
    cluster = module.SlurmCluster(root, nodes_count=2)
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


def in_cluster(cluster: Any, *argv: str, cwd: Path, timeout: float = 240,
               **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ddpkit ARGV`` as a client of the cluster (in the controller node's namespace)."""
    return subprocess.run([*cluster.client_prefix(), sys.executable, "-m", "ddpkit", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=ddpkit_env(SLURM_CONF=str(cluster.conf), **env))


def healing_cluster(prefix: str) -> Iterator[Any]:
    """A three-node cluster of a heal test module's own (``yield from`` it in a module fixture): its drills leave
    nodes stopped or cut off for a while, which no other module should meet."""
    require_root("Slurm daemons, munged as user munge, network namespaces")
    require_tools(*slurm_cluster.TOOLS)
    cluster = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix=prefix)), nodes_count=3)
    cluster.start(timeout=120)
    try:
        yield cluster
    finally:
        cluster.stop()


def heal_fixtures(prefix: str) -> tuple[Any, Any]:
    """A heal test module's two fixtures, both of module scope (``cluster, uninterrupted = heal_fixtures(PREFIX)``):
    ``cluster``, its own three-node cluster (healing_cluster), and ``uninterrupted``, HEAL_TRAIN on two local ranks,
    never interrupted: its summary (the loss history a healed job must equal)."""

    @pytest.fixture(scope="module", name="cluster")
    def cluster() -> Iterator[Any]:
        yield from healing_cluster(prefix)

    @pytest.fixture(scope="module", name="uninterrupted")
    def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        return uninterrupted_train(tmp_path_factory.mktemp("uninterrupted"), *HEAL_TRAIN[1:], timeout=HEAL_JOB_TIMEOUT)

    return cluster, uninterrupted


def submit_healing(c: Any, cwd: Path, *job: str, shape: tuple[str, ...] = ("-j", "2x1", "--spare-nodes", "1"),
                   heal: tuple[str, ...] = ("--heal",)) -> subprocess.Popen[str]:
    """``ddpkit submit slurm SHAPE HEAL --wait -- JOB`` from ``cwd`` as a client of the healing cluster ``c``, its
    output piped; the client waits HEAL_JOB_TIMEOUT for the job."""
    argv = [*c.client_prefix(), sys.executable, "-m", "ddpkit", "submit", "slurm", *shape, *heal, "--wait",
            "--wait-timeout", str(HEAL_JOB_TIMEOUT), "--venv", VENV, "--", *job]
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ddpkit_env(SLURM_CONF=str(c.conf)))


def clean_heal_run(c: Any, where: Path, heal: tuple[str, ...] = ("--heal",)) -> tuple[str, list[Any]]:
    """A short healthy training submitted with ``heal`` from ``where``: the job must complete in its one run
    (restarts 0), its one attempt ended with exit 0; its log and its ledger's records, for what else a module checks."""
    from ddpkit.rundir.ledger import AttemptEnded

    proc = submit_healing(c, where, "train", "--epochs", "3", "--samples", "1024", "--snapshot-path",
                          str(where / "snap.pt"), heal=heal)
    out, _ = proc.communicate(timeout=HEAL_JOB_TIMEOUT + 60)
    log = job_log(where)
    assert proc.returncode == 0 and "COMPLETED exit code 0 (restarts 0)" in out, out + log
    records = job_ledger(where)
    assert [(r.exit_code, r.action.value) for r in records if isinstance(r, AttemptEnded)] == [(0, "stop")]
    return log, records


def pids_on(node: Any, keep: Callable[[list[bytes]], bool]) -> list[int]:
    """The processes in a node's network namespace whose command line (its words) ``keep`` accepts."""
    res = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=False)
    found = []
    for pid in res.stdout.split():
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if keep(words):
            found.append(int(pid))
    return found


def job_log(cwd: Path) -> str:
    """Every line of the job's Slurm log(s) under ``cwd/logs``."""
    return "\n".join(p.read_text(errors="replace") for p in sorted((cwd / "logs").glob("*.out")))


def job_ledger(cwd: Path) -> list[Any]:
    """The records of the one heal run under ``cwd/.ddpkit-runs``."""
    from ddpkit.rundir.ledger import Ledger

    (run,) = list((cwd / ".ddpkit-runs").glob("slurm-*"))
    return Ledger(run).records()
