"""Import boundaries a user feels: rendering a job file on a login node or laptop loads no torch, no launcher,
no rendezvous code and no launcher detection (each of which costs seconds, or is not installed there)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ddpkit_env

RENDER_EVERY_BACKEND = """
import json, sys
from ddpkit.jobs.cli import render
from ddpkit.jobs.spec import JobSpec
from ddpkit.base.shape import parse_job_shape

for backend in ("slurm", "torchrun", "mpi"):
    spec = JobSpec(backend=backend, shape=parse_job_shape("2x2"), command=("check",), rdzv_endpoint="node1:29400")
    assert render(spec)
print(json.dumps(sorted(sys.modules)))
"""

#: Modules that rendering must leave unloaded: the heavy or launcher-side parts.
FORBIDDEN = ("torch", "ddpkit.launch.agent", "ddpkit.launch.addresses", "ddpkit.launch.rendezvous",
             "ddpkit.base.netinfo", "ddpkit.cli", "ddpkit.runtime", "ddpkit.env")


def test_rendering_jobs_loads_no_torch_launcher_or_detection() -> None:
    proc = subprocess.run([sys.executable, "-c", RENDER_EVERY_BACKEND], capture_output=True, text=True, timeout=120,
                          env=ddpkit_env())
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "ddpkit.jobs.slurm" in loaded  # the script did render through the real modules
    assert not [m for m in FORBIDDEN if m in loaded], sorted(m for m in loaded if m.startswith(FORBIDDEN))


def test_the_launcher_does_not_import_the_cli_back() -> None:
    """The agent takes its entrypoint as a parameter (as torch's elastic_launch does): no launch -> cli cycle."""
    code = "import json, sys, ddpkit.launch.agent, ddpkit.launch.worker; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ddpkit_env())
    assert proc.returncode == 0, proc.stderr
    assert "ddpkit.cli" not in set(json.loads(proc.stdout.splitlines()[-1]))
