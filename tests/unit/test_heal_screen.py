"""The heal supervisor's screen of an attempt (``heal.slurm_supervisor.AttemptScreen``): every line whole in the full
log, the job's log without srun's labels, torch's C++ frames or, once a rank failed, the peers' tracebacks and
srun's lines; the supervisor's own lines always shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.heal.slurm_supervisor import AttemptScreen

LINES = [
    "0: [node1:0] WARNING OMP_NUM_THREADS set to 1",
    "1: ddpkit watch: rank 0 on host node1 (pid 8857) stopped answering: no heartbeat for 10 s",
    "1: Traceback (most recent call last):",
    '1:   File "/venv/ddpkit/train/trainer.py", line 3, in fit',
    "1: RuntimeError: Connection closed by peer",
    "1: frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f5cc6379b8d in libc10.so)",
    "srun: error: node2: task 1: Exited with exit code 3",
    "ddpkit heal: srun has not ended the attempt-1 step 5 s after a task failed: interrupting it",
]


def test_a_failed_attempt_shows_the_report_and_keeps_every_line_in_the_full_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "job_5.full.log"
    with AttemptScreen(str(log)) as screen:
        for line in LINES:
            screen.line(line)
        screen.ended(failed=True)
    shown = capsys.readouterr().out.splitlines()
    assert shown == ["[node1:0] WARNING OMP_NUM_THREADS set to 1",
                     "ddpkit watch: rank 0 on host node1 (pid 8857) stopped answering: no heartbeat for 10 s",
                     "ddpkit heal: srun has not ended the attempt-1 step 5 s after a task failed: interrupting it",
                     f"ddpkit heal: every line of the attempt's ranks and srun, in full: {log}"], shown
    assert log.read_text().splitlines() == LINES


def test_a_clean_attempt_shows_a_handled_traceback_at_its_end(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with AttemptScreen(str(tmp_path / "full.log")) as screen:
        for line in ("0: Traceback (most recent call last):", "0: KeyError: 'x'", "0: epoch 1 loss 0.5"):
            screen.line(line)
        screen.ended(failed=False)
    assert capsys.readouterr().out.splitlines() == ["Traceback (most recent call last):", "KeyError: 'x'",
                                                    "epoch 1 loss 0.5"]
