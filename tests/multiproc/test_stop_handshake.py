"""Whose SIGTERM is it: the worker waits for its agent's word, never a guess by the clock (a loaded agent once took
over 2 s to mark a preemption, and its ranks took the signal for their agent's own stop). Real torch agent, real
signals: the agent's own stop after a failure is said before its SIGTERM; a signal from outside marked late is still
read as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ddpkit.process.stopping import mark_outside_signal, mark_own_stop, signal_from_outside
from tests.helpers import ddpkit_env

pytestmark = pytest.mark.multiproc
ROOT = Path(__file__).resolve().parents[2]
AGENT = """
import sys
from ddpkit.base.shape import parse_job_shape
from ddpkit.launch.agent import Entrypoint, LaunchOptions, launch
result = launch(LaunchOptions(shape=parse_job_shape("2"), rank_logs=False),
                Entrypoint(main=lambda argv: 0, module="tests.multiproc.stop_handshake_worker"), [sys.argv[1]])
print("agent exit", result.exit_code)
"""


def test_torch_agent_says_it_stops_its_workers_itself_before_its_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    env = ddpkit_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", AGENT, str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    text = done.stdout + done.stderr
    assert "agent exit 1" in text, text  # rank 1's failure
    # rank 0 got its agent's SIGTERM and read the agent's word (with a 600 s grace: without the word it would have
    # been killed 30 s later and written nothing)
    assert json.loads(out.read_text()) == {"received": ["SIGTERM"], "outside": False}, text


def test_a_late_mark_from_outside_is_still_heard_and_an_own_stop_is_per_process(tmp_path: Path) -> None:
    stops = str(tmp_path)
    late = threading.Timer(3.0, mark_outside_signal, (stops, "SIGTERM"))  # a loaded agent: its handler 3 s late
    late.start()
    try:
        assert signal_from_outside("SIGTERM", stops, grace=30)
    finally:
        late.cancel()
    other = tmp_path / "own"
    other.mkdir()
    mark_own_stop(str(other), [os.getpid() + 1])  # another worker's stop is not this one's
    assert not signal_from_outside("SIGTERM", str(other), grace=0.3)  # its own word never came
    mark_own_stop(str(other), [os.getpid()])
    assert not signal_from_outside("SIGTERM", str(other), grace=600)  # at once: the word is there
    mark_outside_signal(stops, "SIGTERM")
    mark_own_stop(stops, [os.getpid()])  # after a signal from outside, the agent's stop is that signal's
    assert signal_from_outside("SIGTERM", stops, grace=600)
