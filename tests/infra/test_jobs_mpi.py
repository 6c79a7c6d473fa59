"""The rendered mpi command really runs: Open MPI starts the ranks, the script gives them a master, ddpkit's
Open MPI detection reads the rest, and the job (check, or env --connect before check exists) passes."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from ddpkit.cli import COMMANDS
from tests.conftest import IS_ROOT, ddpkit_env, require_tools, run_ddpkit

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]


def test_rendered_openmpi_script_runs_the_job(tmp_path: Path) -> None:
    require_tools("mpirun")
    script = tmp_path / "job dir" / "run mpi.sh"
    script.parent.mkdir()
    cmd = ["check"] if "check" in COMMANDS else ["env", "--connect", "--json", "--timeout", "90"]
    root = ["--allow-run-as-root"] if IS_ROOT else []
    with socket.socket() as s:  # a free port: other test runs may share this machine
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    res = run_ddpkit("submit", "mpi", "-j", "1x2", *root, "--python", sys.executable, "--port", port,
                     "-o", str(script), "--", *cmd, timeout=240, cwd=tmp_path, env=ddpkit_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert script.read_text().count("mpirun -np 2") == 1
    if "check" not in COMMANDS:
        ranks = [json.loads(line.split("]", 1)[1].split(":", 1)[1]) for line in res.stdout.splitlines()
                 if '"launcher"' in line]
        assert sorted(r["rank"] for r in ranks) == [0, 1]
        assert {r["launcher"] for r in ranks} == {"openmpi"}
        assert all(r["connect"]["all_reduce_ok"] for r in ranks)
