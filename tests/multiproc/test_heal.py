"""`ddpkit run -n 2 --heal`: a rank killed by SIGKILL, or stopped (SIGSTOP) and named by the watch, is relaunched
and the run completes; a script that raises on every rank stops after two attempts with exit 93 (do not requeue),
the exception first; a clean run is one attempt; under torchrun --heal is refused. Each reads the run's ledger as
a user would (ddpkit.rundir.ledger)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.heal.classify import FailureClass
from ddpkit.heal.policy import EXIT_DO_NOT_REQUEUE
from ddpkit.rundir.ledger import Action, AttemptEnded, AttemptStarted, Ledger
from tests.helpers import GLOO_OPENING, ddpkit_env, raises_at_step, run_ddpkit

pytestmark = pytest.mark.multiproc

#: rank 1 sends itself SIGNAL at step 2 of the first attempt only (its marker file, holding the time, says an
#: attempt already did): SIGKILL as the OOM killer ends a process, SIGSTOP as a frozen host (alive, silent); every
#: rank prints when it finished its first step, for the time from the fault to the next attempt's first step
FAULT_ONCE = "import os, signal, sys, time\n" + GLOO_OPENING + """\
rank = dist.get_rank()
marker = sys.argv[1]
t = torch.ones(4)
for step in range(4):
    dist.all_reduce(t)
    time.sleep(0.1)
    if step == 0:
        print(f"FIRST_STEP rank={rank} at={time.time():.3f}", flush=True)
    if step == 2 and rank == 1 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(f"{time.time():.3f}")
        os.kill(os.getpid(), signal.SIGNAL)
print(f"DONE rank={rank}", flush=True)
dist.destroy_process_group()
"""
KILLED_ONCE = FAULT_ONCE.replace("SIGNAL", "SIGKILL")
STOPPED_ONCE = FAULT_ONCE.replace("SIGNAL", "SIGSTOP")

RAISES = raises_at_step(2, 4) + "dist.destroy_process_group()\n"

CLEAN = GLOO_OPENING + """\
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
dist.destroy_process_group()
"""


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(text)
    return path


def _ended(run_dir: Path) -> list[AttemptEnded]:
    return Ledger(run_dir).ended()


def test_a_rank_killed_by_sigkill_is_relaunched_and_the_run_completes(tmp_path: Path) -> None:
    script, marker, run_dir = _script(tmp_path, KILLED_ONCE), tmp_path / "killed-once", tmp_path / "run"
    res = run_ddpkit("run", "-n", "2", "--heal", "--run-dir", str(run_dir), "--", str(script), str(marker),
                     timeout=240, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert sorted(re.findall(r"DONE rank=(\d)", res.stdout)) == ["0", "1"], out
    ended = _ended(run_dir)
    assert [e.attempt for e in ended] == [1, 2], out
    first = ended[0]
    assert first.action is Action.RETRY and first.exit_code == 137
    assert first.classification is not None and first.classification.kind is FailureClass.HOST
    assert first.classification.culprit_ranks == (1,)
    assert any("rank 1" in line and "SIGKILL" in line for line in first.classification.evidence)
    assert ended[1].action is Action.STOP and ended[1].exit_code == 0
    line = "ddpkit heal: attempt 1 of 3: rank 1 on host"
    assert line in res.stderr and "was killed by SIGKILL (host fault); relaunching" in res.stderr, out
    starts = [r for r in Ledger(run_dir).records() if isinstance(r, AttemptStarted)]
    assert [s.attempt for s in starts] == [1, 2] and starts[0].ranks == 2
    # from the kill to the relaunched attempt's first step (the last FIRST_STEP line is the second attempt's)
    killed_at = float(marker.read_text())
    next_step = max(float(t) for t in re.findall(r"FIRST_STEP rank=\d at=([\d.]+)", res.stdout))
    print(f"kill -> relaunched attempt's first step: {next_step - killed_at:.2f} s")
    assert 0 < next_step - killed_at < 60, out


def test_a_rank_that_stopped_answering_is_a_host_fault_named_by_the_watch_and_relaunched(tmp_path: Path) -> None:
    script, run_dir = _script(tmp_path, STOPPED_ONCE), tmp_path / "run"
    # no --hang-after: the silent rule of --heal (10 s) names it, long before the hang deadline (60 s and more)
    res = run_ddpkit("run", "-n", "2", "--heal", "--run-dir", str(run_dir), "--",
                     str(script), str(tmp_path / "stopped-once"), timeout=240, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    first, second = _ended(run_dir)
    assert first.classification is not None and first.classification.kind is FailureClass.HOST, out
    assert first.classification.culprit_ranks == (1,)
    assert first.classification.reason.startswith("rank 1 on host ") and "stopped answering" in \
        first.classification.reason
    assert any("stopped answering" in line for line in first.classification.evidence)
    assert first.action is Action.RETRY and second.exit_code == 0
    assert "under --heal a silent rank is a lost host after 10 s" in out, out


def test_an_exception_on_every_rank_stops_after_two_attempts_with_do_not_requeue(tmp_path: Path) -> None:
    script, run_dir = _script(tmp_path, RAISES), tmp_path / "run"
    res = run_ddpkit("run", "-n", "2", "--heal", "--run-dir", str(run_dir), "--", str(script), timeout=240,
                     cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == EXIT_DO_NOT_REQUEUE == 93, out
    ended = _ended(run_dir)
    assert len(ended) == 2, out
    assert all(e.classification is not None and e.classification.kind is FailureClass.JOB for e in ended)
    assert [e.action for e in ended] == [Action.RETRY, Action.STOP]
    decision = next(line for line in res.stderr.splitlines() if line.startswith("ddpkit heal: attempt 2 of 3:"))
    cause = decision.removeprefix("ddpkit heal: attempt 2 of 3: ")
    assert cause.startswith("ValueError: bad batch at step 2"), decision  # the cause first
    assert "exit 93 (do not requeue" in decision


def test_clean_runs_are_one_attempt_each(tmp_path: Path) -> None:
    script = _script(tmp_path, CLEAN)
    for n in range(5):
        run_dir = tmp_path / f"run-{n}"
        res = run_ddpkit("run", "-n", "2", "--heal", "--run-dir", str(run_dir), "--", str(script), timeout=120,
                         cwd=tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        ended = _ended(run_dir)
        assert [(e.attempt, e.action, e.classification) for e in ended] == [(1, Action.STOP, None)], res.stderr
        assert "relaunching" not in res.stderr


def test_the_default_run_directory_is_said_once_under_the_current_directory(tmp_path: Path) -> None:
    script = _script(tmp_path, CLEAN)
    res = run_ddpkit("run", "-n", "2", "--heal", "--", str(script), timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (said,) = [line for line in res.stderr.splitlines() if "run directory" in line]
    (run_dir,) = (tmp_path / ".ddpkit-runs").iterdir()
    assert f".ddpkit-runs/{run_dir.name}" in said and len(_ended(run_dir)) == 1


def test_under_torchrun_heal_is_refused_with_one_error_line(tmp_path: Path) -> None:
    script = _script(tmp_path, CLEAN)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          "-m", "ddpkit", "run", "--heal", "--", str(script)], capture_output=True, text=True,
                         timeout=120, env=ddpkit_env(), cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert re.search(r"exitcode\s*:\s*2\b", out), out  # the rank's own exit: a usage error, before any work
    errors = [line for line in out.splitlines() if line.startswith("ddpkit: error:")]
    assert errors == ["ddpkit: error: --heal under torchrun: ddpkit does not start the ranks here, so it cannot "
                      "start them again."], out
    assert "ddpkit heal:" not in out and not (tmp_path / ".ddpkit-runs").exists()
