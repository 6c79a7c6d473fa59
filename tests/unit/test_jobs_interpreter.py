"""Which Python a generated job runs (issue 18), and Slurm status lines without a made-up reason.

A job submitted from a venv that is not on PATH once called ``torchrun`` by name and failed on every node:
with no environment option, the job runs the submitting interpreter by absolute path, and says so in its header.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.base.shape import parse_job_shape
from ddpkit.jobs import mpi, slurm, slurmctl, torchrun
from ddpkit.jobs.interpreter import filesystem_of, job_interpreter, placement_notes
from ddpkit.jobs.spec import JobSpec
from tests.unit.rendered import shell_commands

#: A submitting interpreter with every shell-special character a path can hold.
HOSTILE_PYTHON = "/opt/v $(touch x) `id` it's/bin/python"


def spec(backend: str, shape: str = "2x2", **kw: object) -> JobSpec:
    extra = {"rdzv_endpoint": "node1:29400"} if backend == "torchrun" and shape != "1x2" else {}
    return JobSpec(backend=backend, shape=parse_job_shape(shape), command=("check",), **{**extra, **kw})  # type: ignore[arg-type]


def launched(text: str, first: str) -> list[str]:
    """The words of the script's command that starts with ``first`` (srun, mpirun, or the interpreter itself); a
    Slurm step's srun is the one after ``PYTHON -m ddpkit step --``, which runs it."""
    commands = [c[c.index("--") + 1:] if c[1:4] == ["-m", "ddpkit", "step"] else c for c in shell_commands(text)]
    (command,) = [c for c in commands if c[0] == first]
    return command


@pytest.mark.parametrize(("backend", "shape", "kw", "first"), [
    ("slurm", "2x2", {}, "srun"), ("slurm", "2x2", {"tasks_per_rank": True}, "srun"),
    ("torchrun", "2x2", {}, HOSTILE_PYTHON), ("torchrun", "2x2", {"static": True}, HOSTILE_PYTHON),
    ("mpi", "2x2", {"hosts": ("n1", "n2")}, "mpirun"), ("mpi", "1x2", {"mpi_flavour": "mpich"}, "mpiexec.mpich")])
def test_without_an_environment_the_job_runs_the_submitting_interpreter(backend: str, shape: str,
                                                                       kw: dict[str, object], first: str) -> None:
    """Parsed as bash parses it: the interpreter is one word, by absolute path, followed by -m (torch's launcher
    or ddpkit), and no ``torchrun`` or bare ``python`` is looked up on PATH."""
    s = spec(backend, shape, submitter=HOSTILE_PYTHON, **kw)
    module = {"slurm": slurm, "torchrun": torchrun, "mpi": mpi}[backend]
    text = module.render(s)
    words = launched(text, first)
    at = words.index(HOSTILE_PYTHON)
    expected = ["-m", "ddpkit", "check"] if backend == "mpi" or kw.get("tasks_per_rank") else \
        ["-m", "torch.distributed.run"]
    assert words[at + 1:at + 1 + len(expected)] == expected, words
    assert "torchrun" not in words and "python" not in words
    header = [line for line in text.splitlines() if line.startswith("# Python: ")]
    assert len(header) == 1 and "the interpreter that ran ddpkit submit" in header[0]
    assert "(no --venv, --conda-env or container image was given)" in header[0]
    assert not (Path.cwd() / "x").exists()


@pytest.mark.parametrize(("kw", "runs", "why"), [
    ({"venv": "/shared/venv"}, "torchrun", "virtual environment activated below (--venv)"),
    ({"conda_env": "ddp"}, "torchrun", "conda environment activated below (--conda-env)"),
    ({"container_image": "img.sqsh"}, "torchrun", "from the container image"),
    ({"python": "/opt/py/bin/python3"}, "/opt/py/bin/python3", "chosen with --python"),
    ({"venv": "/shared/venv", "python": "python3"}, "python3", "chosen with --python after activating")])
def test_an_environment_or_python_option_names_the_interpreter(kw: dict[str, object], runs: str, why: str) -> None:
    text = slurm.render(spec("slurm", submitter="/never/used/python", **kw))
    srun = launched(text, "srun")
    assert runs in srun and "/never/used/python" not in text, text
    (header,) = [line for line in text.splitlines() if line.startswith("# Python: ")]
    assert why in header


def test_kubernetes_keeps_the_images_python() -> None:
    s = spec("k8s", image="reg/ddpkit:cpu", submitter="/home/me/.venv/bin/python")
    assert job_interpreter(s).path == "python" and placement_notes(s) == []


def test_the_python_api_defaults_to_the_running_interpreter() -> None:
    s = spec("slurm")
    assert job_interpreter(s).path == sys.executable and job_interpreter(s).submitter


@pytest.mark.parametrize("submitter", ["", "python3", "/opt/a\nb/python"])
def test_an_unusable_submitting_interpreter_is_refused(submitter: str) -> None:
    with pytest.raises(ConfigError, match="--python PATH"):
        spec("slurm", submitter=submitter)
    spec("slurm", submitter=submitter, venv="/shared/venv")  # not written into the job: fine


def test_a_python_in_a_temporary_directory_is_warned_about(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)
    (note,) = placement_notes(spec("slurm", submitter=str(python)))
    assert note.startswith("ddpkit: warning:") and "temporary directory" in note and str(python) in note
    # a job on this host only: nothing to say
    assert placement_notes(spec("torchrun", "1x2", submitter=str(python))) == []


def test_a_missing_python_is_warned_about(tmp_path: Path) -> None:
    (note,) = placement_notes(spec("mpi", "1x2", python=str(tmp_path / "nope" / "python")))
    assert "does not exist on this host" in note


def test_the_filesystem_of_a_path_is_read_from_the_mount_table() -> None:
    fstype, mount = filesystem_of("/proc/self/status")
    assert (fstype, mount) == ("proc", "/proc")


# Lines as squeue -h -o '%T %r' prints them (slurm-wlm 22.05): a running job's reason is the word None.
@pytest.mark.parametrize(("line", "shown"), [
    ("PENDING Resources", "PENDING Resources"), ("PENDING None", "PENDING"), ("RUNNING None", "RUNNING"),
    ("PENDING BeginTime", "PENDING BeginTime"), ("COMPLETING None\n", "COMPLETING"),
    ("PENDING (null)", "PENDING"), ("RUNNING", "RUNNING")])
def test_a_status_line_shows_a_reason_only_when_slurm_gives_one(line: str, shown: str) -> None:
    assert slurmctl.describe(line) == shown


def test_scontrol_reason_none_is_no_reason() -> None:
    # scontrol show job -o, trimmed: "Reason=None" for a running job
    line = "JobId=7 JobName=ddpkit-check JobState=RUNNING Reason=None Dependency=(null) Restarts=0"
    kv = dict(slurmctl._KV.findall(line))
    assert slurmctl.reason_text(kv["Reason"]) == "" and slurmctl.reason_text("NonZeroExitCode") == "NonZeroExitCode"
