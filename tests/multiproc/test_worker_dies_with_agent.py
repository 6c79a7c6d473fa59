"""A worker of ddpkit's launcher never outlives its agent (torch starts workers in their own session)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multiproc

# The "agent" starts a "worker" in a new session (as torch does), prints its pid, then waits to be killed.
AGENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(worker.pid, flush=True)
time.sleep(600)
"""
WORKER = "from ddpkit.launch.worker import die_with_agent; import time; {call}; time.sleep(600)"


def _orphan_survives(call: str) -> bool:
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER.format(call=call)], stdout=subprocess.PIPE,
                             text=True)
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    time.sleep(1.5)  # let the worker import ddpkit and make its request
    agent.send_signal(signal.SIGKILL)
    agent.wait(timeout=30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{worker}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, not yet reaped by its new parent
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    return True


def test_worker_dies_with_its_agent() -> None:
    assert _orphan_survives("pass"), "control: without the request the orphan should survive"
    assert not _orphan_survives("die_with_agent()")
