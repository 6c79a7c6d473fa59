"""Gradients averaged through MPI (train --grad-transport mpi), under real mpirun (Open MPI) and mpiexec (MPICH).

One gloo run under mpirun is the reference: the MPI runs must end bitwise equal to it (2 ranks: every element is
a + b on either path), also after a preemption (the stop flag rides MPI's last bucket) and a rerun that resumes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpkit.train.snapshot import SnapshotDir
from tests.helpers import ddpkit_env, require_tools, same_state
from tests.multiproc.test_train import _final

pytestmark = pytest.mark.infra

JOB = ("--samples", "512", "--epochs", "4", "--seed", "7")
OPENMPI = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
MPICH = ["mpiexec.mpich", "-n", "2"]
#: a Python whose mpi4py cannot be imported, as in a venv without ddpkit[mpi]
NO_MPI4PY = ["-c", "import sys; sys.modules['mpi4py'] = None; from ddpkit.cli import main; sys.exit(main())"]


def _ddpkit(launcher: list[str], *args: str, timeout: float = 240, python: list[str] | None = None,
            **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*launcher, sys.executable, *(python or ["-m", "ddpkit"]), *args], capture_output=True,
                          text=True, timeout=timeout, env=ddpkit_env(**env))


def _train(launcher: list[str], tmp: Path, *extra: str, **env: str) -> tuple[subprocess.CompletedProcess[str],
                                                                             dict[str, Any] | None]:
    tmp.mkdir(parents=True, exist_ok=True)
    done = _ddpkit(launcher, "train", *JOB, "--snapshot-path", str(tmp / "snap.pt"), "--json",
                   str(tmp / "summary.json"), *extra, **env)
    summary = json.loads((tmp / "summary.json").read_text()) if (tmp / "summary.json").exists() else None
    return done, summary


@pytest.fixture(scope="module")
def gloo_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_tools("mpirun")
    tmp = tmp_path_factory.mktemp("gloo")
    done, summary = _train(OPENMPI, tmp, "--grad-transport", "gloo")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert summary is not None and summary["grad_transport"] == "gloo-gather"
    return tmp


def test_openmpi_auto_picks_mpi_and_equals_gloo_bitwise(gloo_reference: Path, tmp_path: Path) -> None:
    done, summary = _train(OPENMPI, tmp_path)  # --grad-transport auto (the default)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert summary is not None and summary["grad_transport"] == "mpi" and summary["global_step"] == 32
    assert done.stderr.count("gradients averaged through MPI (Open MPI") == 1  # said once, by rank 0
    assert "\x00" not in done.stderr
    assert same_state(_final(tmp_path)[1], _final(gloo_reference)[1], ("model", "optimizer", "rng", "loss_history"))


def test_openmpi_preempted_then_resumed_equals_gloo_bitwise(gloo_reference: Path, tmp_path: Path) -> None:
    args = ("--grad-transport", "mpi", "--drill", "preempt@epoch=2")
    done, summary = _train(OPENMPI, tmp_path, *args)
    assert done.returncode == 75, done.stdout + done.stderr[-3000:]
    assert summary is not None and summary["preempted"] and summary["stop_flags"] == "gradient all-reduce"
    # signalled after step 21 on rank 0: the flag rides step 22's last MPI bucket, both ranks stop after step 22
    (_, path), *_ = SnapshotDir(tmp_path, "snap", ".pt", keep=1).candidates()
    assert path.name == "snap.000000022.pt"
    again, summary = _train(OPENMPI, tmp_path, *args)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert "Resuming training from snapshot at Epoch 2, step 6" in again.stdout
    assert summary is not None and summary["grad_transport"] == "mpi"
    assert same_state(_final(tmp_path)[1], _final(gloo_reference)[1])


def test_mpich_mpi_transport_equals_gloo_bitwise(gloo_reference: Path, tmp_path: Path) -> None:
    require_tools("mpiexec.mpich")
    libdir = tmp_path / "lib"  # Debian names MPICH's library libmpich.so.12; mpi4py's MPICH module links libmpi.so.12
    libdir.mkdir()
    (libdir / "libmpi.so.12").symlink_to("/usr/lib/x86_64-linux-gnu/libmpich.so.12")
    done, summary = _train([*MPICH, "-genv", "LD_LIBRARY_PATH", str(libdir)], tmp_path / "run", "--grad-transport",
                           "mpi")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "gradients averaged through MPI (MPICH" in done.stderr
    assert summary is not None and summary["grad_transport"] == "mpi"
    assert same_state(_final(tmp_path / "run")[1], _final(gloo_reference)[1])


def _refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Epoch" not in done.stdout
    for word in words:
        assert word in done.stderr, done.stderr[-3000:]


def test_refusals_say_what_to_install_or_how_to_launch(tmp_path: Path) -> None:
    require_tools("mpirun", "mpiexec.mpich")
    # no MPI launcher: ddpkit's own launcher starts the ranks
    _refused(_ddpkit([], "train", "-n", "2", "--grad-transport", "mpi"), "not started by an MPI launcher",
             "mpirun -np N")
    # mpirun, but no mpi4py in this Python
    _refused(_ddpkit(OPENMPI, "train", "--grad-transport", "mpi", python=NO_MPI4PY), "mpi4py is not installed",
             "pip install 'ddpkit[mpi]'")
    # MPICH's mpiexec, but mpi4py loads Open MPI's library: each rank is an MPI world of one, torch's has two
    mismatch = _ddpkit(MPICH, "train", "--grad-transport", "mpi")
    _refused(mismatch, "is not torch's world (rank", "of 2", "libmpi.so.12")
    # auto under the same mismatch: the process group's own transport, with a warning, and training runs
    done = _ddpkit(MPICH, "train", *JOB, "--epochs", "1", "--json", str(tmp_path / "s.json"))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "sees a world of 1 rank" in done.stderr
    assert json.loads((tmp_path / "s.json").read_text())["grad_transport"] == "gloo-gather"


def test_bench_through_mpi_refuses_gpu_buffers() -> None:
    done = _ddpkit(OPENMPI, "bench", "--transport", "both", "--backend", "nccl")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--transport both with the process-group backend nccl" in done.stderr and "Traceback" not in done.stderr


def test_bench_through_mpi_verifies_every_row(tmp_path: Path) -> None:
    require_tools("mpirun")
    out = tmp_path / "bench.json"
    done = _ddpkit(OPENMPI, "bench", "--transport", "both", "-b", "8", "-e", "64K", "-f", "64", "--iters", "3",
                   "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "# through MPI: Open MPI" in done.stdout and "# Out of bounds values : 0 OK" in done.stdout
    assert "\x00" not in done.stdout  # Open MPI's library version ends with a NUL byte
    ops = json.loads(out.read_text())["ops"]
    mpi = [r for r in ops if r.get("transport") == "mpi"]
    assert {r["op"] for r in mpi} == {r["op"] for r in ops if "transport" not in r} and len(mpi) == 7
    cells = [row[p] for r in mpi for row in r["rows"] for p in ("out_of_place", "in_place") if row[p]]
    assert all(r["supported"] for r in mpi) and len(cells) >= 20 and all(c["wrong"] == 0 for c in cells)
    # the verification has teeth on the MPI rows too: a damaged all_reduce result is counted and fails the run
    bad = _ddpkit(OPENMPI, "bench", "--transport", "mpi", "--ops", "all_reduce", "-b", "1K", "-e", "1K",
                  DDPKIT_FAULTS="corrupt:op=all_reduce:rank=1:n=5")
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    assert "all_reduce: 5 wrong elements" in bad.stdout


def test_check_ddp_sync_verifies_the_mpi_path_replicas_identical(tmp_path: Path) -> None:
    require_tools("mpirun")
    out = tmp_path / "check.json"
    done = _ddpkit(OPENMPI, "check", "--grad-transport", "mpi", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (ddp,) = [c for c in json.loads(out.read_text())["checks"] if c["name"] == "ddp-sync"]
    assert ddp["status"] == "PASS" and ddp["detail"].endswith("gradients averaged through MPI")
    assert all(r["max_diff_ranks"] == 0.0 for r in ddp["data"]["per_rank"])  # replicas bitwise identical
