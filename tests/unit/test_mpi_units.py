"""The MPI path's pure logic: which launcher started a rank, when a job asks for MPI, what each renderer emits for
it, and the --grad-transport choices refused before any process starts."""

from __future__ import annotations

import contextlib
import io
import sys
from unittest import mock

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.cli import main
from ddpkit.comm.gradients import plan_transport
from ddpkit.comm.mpi_transport import check_mpi_usable, mpi_library
from ddpkit.env.mpi import mpi_launcher
from ddpkit.jobs.spec import asks_for_mpi


@pytest.mark.parametrize(("environ", "kind"), [
    ({"OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0", "PMIX_NAMESPACE": "x"}, "openmpi"),  # Open MPI's mpirun
    ({"PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.7.0", "SLURM_PROCID": "1"}, "pmix"),  # srun --mpi=pmix
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, "mpich"),  # Hydra
    ({"PMI_FD": "5", "SLURM_PROCID": "0"}, "mpich"),  # srun --mpi=pmi2
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, None),  # srun --mpi=none: not an MPI world
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, None),  # torchrun
])
def test_mpi_launcher(environ: dict[str, str], kind: str | None) -> None:
    assert mpi_launcher(environ) == kind


def test_asks_for_mpi() -> None:
    assert asks_for_mpi(("train", "--epochs", "3", "--grad-transport", "mpi"))
    assert asks_for_mpi(("check", "--grad-transport=mpi")) and asks_for_mpi(("bench", "--transport", "both"))
    assert not asks_for_mpi(("train", "--grad-transport", "auto")) and not asks_for_mpi(("bench", "--transport=torch"))
    assert not asks_for_mpi(("train", "--grad-transport"))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(sys, "argv", ["ddpkit", *argv]), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_slurm_renders_the_mpi_plugin_of_the_flavour() -> None:
    code, out, _ = _cli("submit", "slurm", "--dry-run", "-j", "2x2", "--tasks-per-rank", "--", "train",
                        "--grad-transport", "mpi")
    joined = " ".join(out.replace("\\\n", " ").split())  # the command's words, without the line continuations
    assert code == 0 and "srun --ntasks-per-node=2 --kill-on-bad-exit=1 --label --mpi=pmix " in joined, out
    code, out, _ = _cli("submit", "slurm", "--dry-run", "-j", "2x1", "--tasks-per-rank", "--mpi", "mpich", "--",
                        "bench", "--transport", "mpi")
    assert code == 0 and "--mpi=pmi2" in out and "--mpi=pmix" not in out
    code, out, _ = _cli("submit", "slurm", "--dry-run", "-j", "2x1", "--tasks-per-rank", "--", "train")
    assert code == 0 and "--mpi=" not in out  # gloo jobs are rendered as before
    code, out, _ = _cli("submit", "mpi", "--dry-run", "-j", "1x2", "--", "train", "--grad-transport", "mpi")
    assert code == 0 and "mpirun -np 2" in out and "--grad-transport mpi" in out


@pytest.mark.parametrize("argv", [
    ("slurm", "-j", "2x1"),  # torchrun agents would start the ranks
    ("torchrun", "-j", "1x2"),
    ("k8s", "-j", "2x1", "--image", "r/i:1"),
])
def test_mpi_jobs_where_torchrun_starts_the_ranks_are_refused(argv: tuple[str, ...]) -> None:
    code, out, err = _cli("submit", argv[0], "--dry-run", *argv[1:], "--", "train", "--grad-transport", "mpi")
    assert code == 2 and not out and "asks for MPI" in err


def test_plan_transport_refusals_and_defaults() -> None:
    plain: dict[str, str] = {}
    assert plan_transport("auto", backend="gloo", rank=0, world_size=2, environ=plain) is None
    assert plan_transport("gloo", backend="gloo", rank=0, world_size=2, environ=plain) is None
    with pytest.raises(ConfigError, match="--backend nccl"):
        plan_transport("nccl", backend="gloo", rank=0, world_size=2, environ=plain)
    with pytest.raises(ConfigError, match="not started by an MPI launcher"):
        plan_transport("mpi", backend="gloo", rank=0, world_size=1, environ=plain)
    with pytest.raises(ConfigError, match="host memory"):
        plan_transport("mpi", backend="nccl", rank=0, world_size=2, environ={"OMPI_COMM_WORLD_RANK": "0"})
    with pytest.raises(ConfigError, match="pip install 'ddpkit\\[mpi\\]'"), \
            mock.patch("ddpkit.comm.mpi_transport.mpi4py_installed", return_value=False):
        check_mpi_usable("--grad-transport mpi", {"OMPI_COMM_WORLD_RANK": "0"})


def test_mpi_library_respects_the_users_choice() -> None:
    assert mpi_library("openmpi", {}) is None  # mpi4py's default (libmpi.so) is Open MPI's
    assert mpi_library("mpich", {"MPI4PY_LIBMPI": "/opt/mpich/lib/libmpi.so.12"}) is None
