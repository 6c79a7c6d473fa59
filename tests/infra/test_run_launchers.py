"""`ddpkit run` under the real launchers: the same torchrun-style script (tests/workers/ddp_user.py, it reads RANK
and calls init_process_group("gloo")), unchanged, ends with identical replicas under mpirun (Open MPI), mpiexec
(MPICH), srun with two tasks on each of the test cluster's two namespace nodes, and the jobs `ddpkit submit mpi`
and `ddpkit submit slurm --tasks-per-rank` render (which used to fail: "environment variable RANK expected")."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import IS_ROOT, ddpkit_env, free_port, require_tools, run_ddpkit
from tests.infra.slurm_fixture import in_cluster, slurm_cluster_fixture  # noqa: F401 (the fixture)
from tests.infra.test_jobs_slurm import VENV, _job_id
from tests.multiproc.test_run import SCRIPT, TEARDOWN_PROBE, assert_replicas_identical
from tests.multiproc.test_run_harmless import (
    FAILS,
    STOPS_RANK_0,
    UNCLOSED,
    assert_frozen_rank_0_named,
    assert_written_in_full,
)

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
RUN = [sys.executable, "-m", "ddpkit", "run", "--"]


def _script(tmp_path: Path) -> Path:
    target = tmp_path / "user's dir" / "ddp_user.py"
    target.parent.mkdir(exist_ok=True)
    shutil.copy(SCRIPT, target)
    return target


@pytest.mark.parametrize(("tool", "argv"), [
    ("mpirun", ["mpirun", "-np", "2", "--oversubscribe", *(["--allow-run-as-root"] if IS_ROOT else [])]),
    ("mpiexec.mpich", ["mpiexec.mpich", "-n", "2"]),
])
def test_mpi_launchers_run_the_script_unchanged(tool: str, argv: list[str], tmp_path: Path) -> None:
    require_tools(tool)
    script = _script(tmp_path)
    res = subprocess.run([*argv, *RUN, str(script), "--flag"], capture_output=True, text=True, errors="replace",
                         timeout=240, env=ddpkit_env(MASTER_PORT=free_port()))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = assert_replicas_identical(res.stdout, 2)
    assert {r["argv"] for r in rows.values()} == {f"[{str(script)!r}, '--flag']"}


def test_srun_two_tasks_on_each_of_two_nodes(slurm_cluster: Any, tmp_path: Path) -> None:
    script = _script(tmp_path)
    res = subprocess.run([*slurm_cluster.client_prefix(), "srun", "-N", "2", "--ntasks-per-node=2", *RUN,
                          str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=ddpkit_env(SLURM_CONF=str(slurm_cluster.conf)))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    rows = assert_replicas_identical(res.stdout, 4)
    assert len({r["host"] for r in rows.values()}) == 2, rows  # two namespace hosts, two ranks each
    assert sorted(r["local"] for r in rows.values()) == ["0", "0", "1", "1"]


def test_submit_slurm_tasks_per_rank_runs_a_script(slurm_cluster: Any, tmp_path: Path) -> None:
    script = _script(tmp_path)
    res = in_cluster(slurm_cluster, "submit", "slurm", "--wait", "-j", "2x1", "--tasks-per-rank", "--venv", VENV,
                     "--no-exclusive", "-o", str(tmp_path / "job.sbatch"), "--", str(script), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "-m ddpkit run" in (tmp_path / "job.sbatch").read_text()
    log = in_cluster(slurm_cluster, "logs", _job_id(res), cwd=tmp_path).stdout
    rows = assert_replicas_identical(log, 2)
    assert len({r["host"] for r in rows.values()}) == 2, log


@pytest.mark.parametrize(("flavour", "tool"), [("openmpi", "mpirun"), ("mpich", "mpiexec.mpich")])
def test_submit_mpi_runs_a_script(flavour: str, tool: str, tmp_path: Path) -> None:
    require_tools(tool)
    script = _script(tmp_path)
    root = ["--allow-run-as-root"] if IS_ROOT and flavour == "openmpi" else []
    res = run_ddpkit("submit", "mpi", "-j", "1x2", "--mpi", flavour, *root, "--python", sys.executable, "--port",
                     free_port(), "-o", str(tmp_path / "job.sh"), "--", str(script), "3", "1", timeout=240,
                     cwd=tmp_path, errors="replace")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "-m ddpkit run" in (tmp_path / "job.sh").read_text()
    assert_replicas_identical(res.stdout, 2)


@pytest.mark.parametrize("code", [0, 7])
def test_under_mpirun_a_rank_finalizes_mpi_and_skips_the_teardown(code: int, tmp_path: Path) -> None:
    """With mpi4py loaded, `ddpkit run` still leaves without the interpreter's teardown (where torch 2.13's gloo
    aborted `train --grad-transport mpi` after it finished: src/ddpkit/process/exiting.py), after the atexit handlers
    (MPI still usable there) and an MPI_Finalize of its own: without it, os._exit skips mpi4py's and Open MPI calls the
    job failed; the script's exit code is mpirun's."""
    require_tools("mpirun")
    pytest.importorskip("mpi4py")
    script = tmp_path / "probe.py"
    script.write_text(TEARDOWN_PROBE)
    mark = tmp_path / "mark"
    res = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", *(["--allow-run-as-root"] if IS_ROOT else []),
                          *RUN, str(script), str(mark), str(code), "--mpi"], capture_output=True, text=True,
                         errors="replace", timeout=120, env=ddpkit_env(MASTER_PORT=free_port()))
    assert res.returncode == code, res.stdout + res.stderr
    for rank in (0, 1):
        assert Path(f"{mark}.{rank}.atexit").read_text() == "False", res.stderr  # MPI not yet finalized there
        assert not Path(f"{mark}.{rank}.teardown").exists(), "the interpreter's teardown ran"
    assert "finalize" not in res.stderr.lower() or code != 0, res.stderr


MPIRUN = ["mpirun", "-np", "2", "--oversubscribe", *(["--allow-run-as-root"] if IS_ROOT else [])]


def test_under_mpirun_files_the_script_never_closed_are_written(tmp_path: Path) -> None:
    require_tools("mpirun")
    script = tmp_path / "unclosed.py"
    script.write_text(UNCLOSED)
    res = subprocess.run([*MPIRUN, *RUN, str(script), str(tmp_path)], capture_output=True, text=True,
                         errors="replace", timeout=180, env=ddpkit_env(MASTER_PORT=free_port()))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_written_in_full(tmp_path, 2)


@pytest.mark.parametrize(("how", "code", "said"), [
    ("exit", 5, r"Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+5"),
    ("kill", 137, r"process rank 1 with PID \d+ on node \S+ exited on signal 9"),
])
def test_under_mpirun_the_rank_that_failed_first_is_mpiruns_first(how: str, code: int, said: str,
                                                                   tmp_path: Path) -> None:
    """Rank 0 fails too, because rank 1 is gone: it waits before it leaves, so mpirun sees rank 1 go first, names
    it, and passes its code (or signal) through; the watch names rank 1 gone."""
    require_tools("mpirun")
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    for attempt in range(3):
        res = subprocess.run([*MPIRUN, "-x", "HOW", *RUN, str(script)], capture_output=True, text=True,
                             errors="replace", timeout=180, env=ddpkit_env(MASTER_PORT=free_port(), HOW=how))
        out = res.stdout + res.stderr
        assert res.returncode == code, f"attempt {attempt}: {out[-4000:]}"
        assert re.search(said, out), out[-4000:]
        assert "rank 1 on host" in out and "is gone" in out, out[-4000:]


def test_under_mpirun_a_frozen_rank_0_that_holds_the_store_is_named_and_the_job_stopped(tmp_path: Path) -> None:
    require_tools("mpirun")
    script = tmp_path / "stops.py"
    script.write_text(STOPS_RANK_0)
    events = tmp_path / "events.jsonl"
    res = subprocess.run([*MPIRUN, sys.executable, "-m", "ddpkit", "run", "--hang-after", "8", "--stop-after", "25",
                          "--events", str(events), "--", str(script)], capture_output=True, text=True,
                         errors="replace", timeout=180, env=ddpkit_env(MASTER_PORT=free_port(),
                                                                       MASTER_ADDR="127.0.0.1"))
    out = res.stdout + res.stderr
    assert res.returncode == 3, out[-4000:]
    assert_frozen_rank_0_named(out, [json.loads(x) for x in events.read_text().splitlines()], 8)
