"""``--run-dir`` is checked before anything runs, as every output path is: exit code 2, a message that says what
was found, no traceback, nothing created; with or without ``--heal``, and the parent refuses it before any rank
starts. And ``--heal`` with one rank says so truly (it once said "no -n" after ``-n 1``).

In subprocesses (``python -m ddpkit``), in a scratch working directory: each refusal must come before the heal
supervisor's ledger or a rank's goodput file is written, which in-process tests would not show.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ddpkit_env

#: Refused long before this: parsing takes about a second; a rank started would take several.
TIMEOUT_S = 120


def ddpkit(cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpkit", *argv], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=ddpkit_env(), cwd=cwd)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def refused(cwd: Path, *argv: str, says: str) -> str:
    """Run ``ddpkit ARGV`` in ``cwd``: exit 2, ``says`` in its error, no traceback, ``cwd`` left as it was."""
    before = tree(cwd)
    proc = ddpkit(cwd, *argv)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert says in proc.stderr, out
    assert "ddpkit: error: --" in proc.stderr, out
    assert tree(cwd) == before, f"created: {sorted(tree(cwd) - before)}\n{out}"
    return proc.stderr


@pytest.fixture
def script(tmp_path: Path) -> str:
    """A script ``ddpkit run`` accepts (its script is checked before --heal's supervisor starts)."""
    (tmp_path / "job.py").write_text("print('ran')\n")
    return "job.py"


@pytest.mark.parametrize("heal", [["--heal"], ["--heal", "live"], []], ids=["heal", "heal-live", "no-heal"])
def test_train_run_dir_where_nothing_can_be_created_is_refused(tmp_path: Path, heal: list[str]) -> None:
    """/proc/x: once a FileNotFoundError traceback from the heal ledger (exit 1); without --heal, every rank
    failed on its goodput file, one by one."""
    err = refused(tmp_path, "train", "-n", "2", *heal, "--run-dir", "/proc/x", "--epochs", "1",
                  says="--run-dir '/proc/x': cannot create files in '/proc'")
    assert "Expected: a directory this user can write" in err
    assert "Fix: choose another --run-dir" in err


@pytest.mark.parametrize("heal", [["--heal"], []], ids=["heal", "no-heal"])
def test_run_run_dir_where_nothing_can_be_created_is_refused(tmp_path: Path, script: str, heal: list[str]) -> None:
    refused(tmp_path, "run", "-n", "2", *heal, "--run-dir", "/proc/x", "--", script,
            says="--run-dir '/proc/x': cannot create files in '/proc'")


def test_run_dir_naming_an_existing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    err = refused(tmp_path, "train", "-n", "2", "--heal", "--run-dir", "afile", "--epochs", "1",
                  says="--run-dir 'afile': an existing file, not a directory")
    assert "Expected: a directory, existing or to be created" in err


def test_run_dir_inside_an_existing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    refused(tmp_path, "train", "-n", "2", "--heal", "--run-dir", "afile/sub", "--epochs", "1",
            says="--run-dir 'afile/sub': 'afile' is not a directory")


def test_run_dir_with_a_name_too_long_is_refused(tmp_path: Path) -> None:
    err = refused(tmp_path, "train", "-n", "2", "--heal", "--run-dir", "r" * 5000, "--epochs", "1",
                  says="(5000 characters): a name longer than this filesystem allows")
    assert "r" * 200 not in err  # the name is shown shortened


def test_run_dir_of_an_unknown_user_is_refused_and_no_tilde_directory_is_made(tmp_path: Path) -> None:
    """``~nosuchuser/r`` once became a directory literally named ``~nosuchuser`` in the working directory."""
    refused(tmp_path, "train", "-n", "2", "--heal", "--run-dir", "~nosuchuser/r", "--epochs", "1",
            says="--run-dir '~nosuchuser/r': no user 'nosuchuser' on this machine")
    assert not (tmp_path / "~nosuchuser").exists()


@pytest.mark.parametrize("argv", [["train", "-n", "1", "--heal", "--epochs", "1"],
                                  ["run", "-n", "1", "--heal", "--", "job.py"]], ids=["train", "run"])
def test_heal_with_one_rank_says_so_truly(tmp_path: Path, script: str, argv: list[str]) -> None:
    """``-n 1 --heal`` once said "no -n", although -n 1 was given."""
    err = refused(tmp_path, *argv, says="--heal with one rank on this host (-n 1")
    assert "no -n" not in err
    assert "Expected: -n 2 or more" in err
    assert "Fix: pass -n 2 or more, or drop --heal" in err
