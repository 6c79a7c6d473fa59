"""Rendered torchrun and mpi jobs really run here: Open MPI and MPICH start the ranks and the script gives them
a master; torchrun's static rendezvous joins two agents (two "nodes" on this machine); a standalone 1x2 torchrun
job runs in the foreground. The job is ``check`` (Open MPI) or ``env --connect`` (a process group and one verified
all_reduce: the same proof that the launch works, at a third of the cost on a loaded 2-core machine)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import IS_ROOT, ddpkit_env, free_port, require_tools, run_ddpkit

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
BIN = str(Path(sys.executable).parent)


CONNECT = ["env", "--connect", "--timeout", "90"]  # process group + one verified all_reduce: cheaper than check


@pytest.mark.parametrize(("flavour", "tool", "job"), [("openmpi", "mpirun", ["check"]),
                                                      ("mpich", "mpiexec.mpich", CONNECT)])
def test_rendered_mpi_script_runs_the_job(flavour: str, tool: str, job: list[str], tmp_path: Path) -> None:
    require_tools(tool)
    script = tmp_path / "job dir" / "run mpi.sh"
    script.parent.mkdir()
    root = ["--allow-run-as-root"] if IS_ROOT and flavour == "openmpi" else []
    # Open MPI's --tag-output relays the ranks' output in chunks and tags each: a chunk boundary inside one of the
    # report's box-drawing characters leaves bytes that are not UTF-8 (seen once in 720 runs)
    res = run_ddpkit("submit", "mpi", "-j", "1x2", "--mpi", flavour, *root, "--python", sys.executable, "--port",
                     free_port(), "-o", str(script), "--", *job, timeout=240, cwd=tmp_path, errors="replace")
    assert res.returncode == 0, res.stdout + res.stderr
    assert script.read_text().count(f"{tool} -n") == 1
    if job == ["check"]:
        assert "verdict: PASS: 2 rank(s) on 1 host(s)" in res.stdout
    else:
        assert f"a world of 2 rank(s) on 1 node(s), launcher {flavour}" in res.stdout
        assert "all_reduce of (rank+1) across the world verified on every rank" in res.stdout


def test_rendered_torchrun_scripts_run_check(tmp_path: Path) -> None:
    """Static rendezvous: the same script on two agents (NODE_RANK 0 and 1); then a standalone 1x2 job."""
    script = tmp_path / "run torchrun.sh"
    res = run_ddpkit("submit", "torchrun", "-j", "2x1", "--static", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                     "--dry-run", "-o", str(script), "--", *CONNECT, timeout=60)
    assert res.returncode == 0, res.stderr
    env = ddpkit_env(PATH=f"{BIN}:{os.environ['PATH']}")
    agents = [subprocess.Popen(["bash", str(script)], env={**env, "NODE_RANK": str(i)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=tmp_path) for i in (0, 1)]
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outputs
    assert "a world of 2 rank(s) on 2 node(s), launcher torchrun" in outputs[0], outputs[0]
    missing = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "set NODE_RANK to the index of this node, 0 to 1" in missing.stderr

    res = run_ddpkit("submit", "torchrun", "-j", "1x2", "--", *CONNECT, timeout=240, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "a world of 2 rank(s) on 1 node(s), launcher torchrun" in res.stdout
    assert "all_reduce of (rank+1) across the world verified on every rank" in res.stdout


RAISES_ON_RANK_1 = """\
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for step in range(5):
    dist.all_reduce(t)
    if step == 3 and dist.get_rank() == 1:
        raise KeyError("batch")
dist.destroy_process_group()
"""


def test_a_failed_rendered_torchrun_job_ends_with_its_digest(tmp_path: Path) -> None:
    """Rank 1 raises: the job's screen ends with one digest, cause first (rank 1, this host, its exception), with
    torch's ChildFailedError box and "Root Cause" only in the full log the digest names; torchrun's exit code."""
    (tmp_path / "raises.py").write_text(RAISES_ON_RANK_1)
    res = run_ddpkit("submit", "torchrun", "-j", "1x2", "--python", sys.executable, "--", "raises.py", timeout=240,
                     cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    digest = res.stderr[res.stderr.index("ddpkit: the job failed"):].splitlines()
    host = socket.gethostname().split(".", 1)[0]
    assert digest[0] == f"ddpkit: the job failed (torchrun exit code 1): rank 1 on host {host} failed first with " \
                        "exit code 1", res.stderr
    assert "    KeyError: 'batch'" in digest[:5], res.stderr
    assert "ChildFailedError" not in res.stderr and "Root Cause" not in res.stderr, res.stderr
    log = Path(digest[-1].split(": ", 1)[1])
    assert log.is_file() and "ChildFailedError" in log.read_text() and "KeyError: 'batch'" in log.read_text()


def test_a_signal_to_the_rendered_torchrun_job_reaches_torchrun_once(tmp_path: Path) -> None:
    """SIGTERM to ``ddpkit step`` (a scheduler ending the job; torchrun runs in a session of its own): torchrun gets
    it, ends its ranks and the job ends, by SIGTERM's convention, instead of running on."""
    sleeps = f"sleeps-{uuid.uuid4().hex[:12]}.py"  # its processes found by this name alone
    (tmp_path / sleeps).write_text("import time\ntime.sleep(600)\n")
    script = tmp_path / "job.sh"
    res = run_ddpkit("submit", "torchrun", "-j", "1x2", "--python", sys.executable, "--dry-run", "-o", str(script),
                     "--", sleeps, timeout=60)
    assert res.returncode == 0, res.stderr
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=ddpkit_env())
    step, found = None, []
    for _ in range(600):  # the step's launcher running, its ranks started
        kids = subprocess.run(["pgrep", "-f", "-P", str(job.pid), "ddpkit step"], capture_output=True, text=True)
        step = int(kids.stdout.split()[0]) if kids.stdout.split() else None
        found = subprocess.run(["pgrep", "-f", "--", f"-- {sleeps}"], capture_output=True, text=True).stdout.split()
        if step is not None and len(found) >= 4:  # the step, torchrun and its two ranks
            break
        time.sleep(0.1)
    assert step is not None and len(found) >= 4, f"the job's step and ranks did not start in 60 s: {found}"
    time.sleep(2)
    os.kill(step, signal.SIGTERM)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 1, out  # torchrun's, for a SignalException
    assert out.splitlines()[-1].startswith("ddpkit: torchrun was ended by SIGTERM from outside (passed on by ddpkit "
                                           "step; exit code 1); its full output: "), out
    assert "Traceback" not in out, out  # the agent's SignalException: in the full log only


@pytest.mark.parametrize(("flavour", "fault", "code", "first"), [
    ("openmpi", "raise KeyError('batch')", 1, "(mpirun exit code 1): rank 1 failed first with exit code 1"),
    ("openmpi", "os.kill(os.getpid(), signal.SIGKILL)", 137,
     "(mpirun exit code 137): rank 1 on host {host} was killed by SIGKILL"),
    ("mpich", "raise KeyError('batch')", 1, "(mpiexec exit code 1): rank 1 raised first")])
def test_a_failed_rendered_mpi_job_ends_with_its_digest(flavour: str, fault: str, code: int, first: str,
                                                        tmp_path: Path) -> None:
    """Rank 1 raises or is killed under the rendered mpirun (Open MPI) or mpiexec (MPICH): the screen ends with the
    digest naming rank 1 first (by mpirun's own word; under MPICH, whose mpiexec names no rank, by its own
    exception coming first), its exception under it; mpirun's boxes and rank 0's secondary traceback in the full
    log."""
    require_tools("mpirun" if flavour == "openmpi" else "mpiexec.mpich")
    (tmp_path / "fails.py").write_text("import os, signal\n" + RAISES_ON_RANK_1.replace('raise KeyError("batch")',
                                                                                       fault))
    root = ["--allow-run-as-root"] if IS_ROOT and flavour == "openmpi" else []
    res = run_ddpkit("submit", "mpi", "-j", "1x2", "--mpi", flavour, *root, "--python", sys.executable, "--port",
                     free_port(), "--", "fails.py", timeout=240, cwd=tmp_path, errors="replace")
    assert res.returncode == code, res.stdout + res.stderr
    digest = res.stderr[res.stderr.index("ddpkit: the job failed"):].splitlines()
    host = socket.gethostname().split(".", 1)[0]
    assert digest[0] == "ddpkit: the job failed " + first.format(host=host), res.stderr
    if code == 1:
        assert "    KeyError: 'batch'" in digest[:5], res.stderr
    assert "Process name" not in res.stderr and "mpirun noticed" not in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr  # rank 0's secondary one: in the full log
    log = Path(digest[-1].split(": ", 1)[1]).read_text()
    assert "Traceback" in log and ("Exit code:" in log or "exited on signal 9" in log or flavour == "mpich")
