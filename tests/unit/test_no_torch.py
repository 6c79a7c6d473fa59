"""The commands that need no torch run without it, as on a login node or a laptop: the real console script in a
virtual environment that has ddpkit's light dependencies and no torch at all; and `ddpkit env` imports no torch
where torch is installed (``python -X importtime``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import ROOT, ddpkit_env

#: What ddpkit's light commands import (rich's own dependencies included), found in the test runner's environment.
LIGHT = ("hostlist", "rich", "pygments", "markdown_it", "mdurl", "yaml")


@pytest.fixture(scope="module")
def torchless_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding ddpkit's source and its light dependencies, and no torch: a user's login node."""
    venv = tmp_path_factory.mktemp("no-torch") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in LIGHT:
        found = [p for p in (ours / name, ours / f"{name}.py") if p.exists()]
        assert found, f"{name} is not installed in the test environment ({ours})"
        (Path(purelib) / found[0].name).symlink_to(found[0])
    (Path(purelib) / "ddpkit-src.pth").write_text(str(ROOT / "src") + "\n")
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0, "torch is importable in the venv meant to lack it"
    return python


def _console_script() -> Path:
    script = Path(sys.executable).parent / "ddpkit"
    if not script.exists():
        found = shutil.which("ddpkit")
        assert found, "ddpkit's console script is not installed (pip install -e .)"
        script = Path(found)
    return script


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["--version"],
    ["env"],
    ["env", "--json"],
    ["env", "--explain"],
    ["submit", "slurm", "--dry-run", "-j", "2x2", "--", "check"],
    ["submit", "slurm", "--dry-run", "-j", "2x2", "--tasks-per-rank", "--", "train.py"],
    ["submit", "mpi", "--dry-run", "-j", "2x2", "--hosts", "a,b", "--", "check"],
    ["submit", "torchrun", "--dry-run", "-j", "1x2", "--", "train", "--epochs", "2"],
    ["submit", "k8s", "--dry-run", "-j", "2x2", "--image", "reg/img:1", "--", "check"],
    ["recipe", "--help"],
    ["train", "--help"],
    ["check", "--help"],
    ["bench", "--help"],
])
def test_light_commands_run_without_torch(torchless_python: Path, argv: list[str]) -> None:
    proc = subprocess.run([str(torchless_python), str(_console_script()), *argv], capture_output=True, text=True,
                          timeout=120, env=ddpkit_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
    assert proc.stdout.strip()


@pytest.mark.parametrize("argv", [["check"], ["recipe", "venv"]])  # recipe pins the installed torch's version
def test_a_command_that_needs_torch_says_so_without_a_traceback(torchless_python: Path, argv: list[str]) -> None:
    proc = subprocess.run([str(torchless_python), str(_console_script()), *argv], capture_output=True, text=True,
                          timeout=120, env=ddpkit_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "torch" in proc.stderr and "pip install" in proc.stderr


@pytest.mark.parametrize("argv", [["env"], ["--help"], ["submit", "slurm", "--dry-run", "-j", "1x2", "--", "check"]])
def test_light_commands_import_no_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddpkit", *argv], capture_output=True,
                          text=True, timeout=120, env=ddpkit_env())
    assert proc.returncode == 0, proc.stderr
    modules = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "ddpkit.cli" in modules  # the timing did see ddpkit's own imports
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]


def test_submit_help_loads_few_ddpkit_modules() -> None:
    """``ddpkit submit --help`` loads what it renders with, not the rank's lifecycle and every launcher (it loaded 27
    ddpkit modules when cli.py imported the lifecycle at its top)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddpkit", "submit", "--help"], capture_output=True,
                          text=True, timeout=120, env=ddpkit_env())
    assert proc.returncode == 0, proc.stderr
    modules = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    ours = [m for m in modules if m == "ddpkit" or m.startswith("ddpkit.")]
    assert "ddpkit.cli" in ours and len(ours) <= 15, ours
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]
    # counted at exit too (an import-time line is missed for a module imported before -X importtime reports it)
    code = ("import runpy, sys\nsys.argv = ['ddpkit', 'submit', '--help']\ntry:\n    runpy.run_module('ddpkit', "
            "run_name='__main__')\nexcept SystemExit:\n    pass\nprint(*sorted(m for m in sys.modules if m == 'ddpkit' "
            "or m.startswith('ddpkit.')), file=sys.stderr)\n")
    at_exit = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env=ddpkit_env()).stderr.split()
    assert "ddpkit.cli" in at_exit and len(at_exit) <= 15, at_exit
