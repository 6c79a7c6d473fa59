"""ddpkit.launch.live's rules without torch's processes: a rank still running after another finished is ended only
once it is idle (its teardown hangs), never while it works (rank 0 writing a last checkpoint)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from ddpkit.launch import live


def _rank(rank: int, proc: subprocess.Popen[bytes]) -> Any:
    return live._Rank(rank=rank, env={}, context=None, pid=proc.pid)


def test_a_rank_left_running_is_ended_only_once_idle() -> None:
    idle = subprocess.Popen(["sleep", "60"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        agent = live._Agent(options=None, entrypoint=None, argv=[], on_heal=lambda heal: None)  # type: ignore[arg-type]
        agent.ranks = {1: _rank(1, idle), 2: _rank(2, busy)}
        now = time.time()
        agent.finished_at = now - live.FINISH_GRACE_S - 1  # rank 0 finished, FINISH_GRACE_S ago
        agent._check_lingering(now)  # the first look: CPU time noted
        time.sleep(0.5)  # the busy one uses CPU meanwhile
        agent._check_lingering(now + live.IDLE_S + 1)
        assert agent.ranks[1].ended_by_agent is not None and idle.wait(timeout=10) == -9
        assert agent.ranks[2].ended_by_agent is None and busy.poll() is None
    finally:
        for proc in (idle, busy):
            proc.kill()
            proc.wait()
