"""ddpkit.launch.live's rules without torch's processes: a rank still running after another finished is ended only
once it is idle (its teardown hangs), never while it works (rank 0 writing a last checkpoint)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from ddpkit.launch import live, live_host


@dataclass
class _Popen:
    """A plain child process as the agent's ``Proc``."""

    popen: subprocess.Popen[bytes]
    host: str = "here"
    stopped_word: str = "stopped (SIGSTOP)"
    unseen_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self) -> int | None:
        return self.popen.poll()

    def look(self) -> tuple[str, int]:
        return live_host._stat(self.pid)

    def send(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def close(self) -> None:
        self.popen.kill()


def _rank(rank: int, proc: subprocess.Popen[bytes]) -> Any:
    return live._Rank(rank=rank, env={}, proc=_Popen(proc))


def test_a_rank_left_running_is_ended_only_once_idle() -> None:
    idle = subprocess.Popen(["sleep", "60"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        agent = live.LiveAgent(spawn=lambda rank, env: None, on_heal=lambda heal: None, store=None)
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
