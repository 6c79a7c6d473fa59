"""Detection that fits the action (issue 38, item 2): under a heal supervisor (``DDPKIT_HEAL_SILENT_S``, which
``ddpkit submit slurm --heal`` exports to its steps) a rank whose heartbeat stopped is named and every rank stops
within seconds, not at the watch's hang deadline (60 s at least); a rank that is slow but answering is never
stopped so (the watch's report-early-stop-late rule stands)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import GLOO_OPENING, ddpkit_env, run_ddpkit

pytestmark = pytest.mark.multiproc

#: rank 1 stops (SIGSTOP) at step 20: alive, silent, as every process of a frozen host
STOPPED = "import os, signal, time\n" + GLOO_OPENING + """\
rank = dist.get_rank()
t = torch.ones(4)
for step in range(200):
    dist.all_reduce(t)
    time.sleep(0.05)
    if step == 20 and rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
print(f"DONE rank={rank}", flush=True)
dist.destroy_process_group()
"""

#: rank 1 computes for 12 s at step 3 (the others wait in the next all_reduce): slow, and answering
SLOW = "import time\n" + GLOO_OPENING + """\
rank = dist.get_rank()
t = torch.ones(4)
for step in range(6):
    dist.all_reduce(t)
    if step == 3 and rank == 1:
        time.sleep(12)
print(f"DONE rank={rank}", flush=True)
dist.destroy_process_group()
"""


def _run_under_heal(tmp_path: Path, name: str, text: str) -> tuple[int, str]:
    """`ddpkit run -n 2 -- NAME` (``text`` written there) as under a heal supervisor that calls a rank silent for 5 s
    a lost host: its exit code and its output."""
    script = tmp_path / name
    script.write_text(text)
    res = run_ddpkit("run", "-n", "2", "--", str(script), timeout=120, cwd=tmp_path,
                     env=ddpkit_env(DDPKIT_HEAL_SILENT_S="5"))
    return res.returncode, res.stdout + res.stderr


def test_a_silent_rank_stops_the_job_in_seconds_under_heal(tmp_path: Path) -> None:
    code, out = _run_under_heal(tmp_path, "stopped.py", STOPPED)
    assert code == 3, out
    assert "rank 1 on host " in out and "stopped answering: no heartbeat for" in out, out
    # said by the heal rule alone (the hang deadline's report is a HANG headline): it, not the deadline, stopped it
    assert "under --heal a silent rank is a lost host after 5 s" in out, out


def test_a_slow_rank_that_answers_is_never_stopped_by_the_heal_rule(tmp_path: Path) -> None:
    code, out = _run_under_heal(tmp_path, "slow.py", SLOW)
    assert code == 0, out
    assert "DONE rank=0" in out and "DONE rank=1" in out and "stopped answering" not in out, out
