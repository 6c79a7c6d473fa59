"""`ddpkit train -n 3 --heal` with rank 1 stopped (SIGSTOP: a frozen host) or killed (SIGKILL) from outside, mid-run
(issue 44, item 3): the decision line and the ledger name rank 1 and its host as a host fault, from the watch's
typed abort order and torch's typed failure (train keeps no rank logs to read), and the relaunched attempt
completes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.heal.classify import FailureClass
from ddpkit.rundir.ledger import Action, Ledger
from tests.helpers import ddpkit_env, killed_if_left, wait_until

pytestmark = pytest.mark.multiproc
HOST = socket.gethostname().split(".", 1)[0]


def _workers(agent: int) -> list[int]:
    """The agent's forked workers (its children running the same command line), in the order they started: the
    local ranks 0, 1, 2."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    return sorted(int(c) for c in children if cmdline(int(c)) == cmdline(agent))


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_rank_1_stopped_or_killed_is_a_host_fault_named_by_the_decision_and_the_ledger(
        tmp_path: Path, sig: signal.Signals) -> None:
    (tmp_path / "snaps").mkdir()
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        agent = subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "-n", "3", "--heal", "--run-dir", "run",
                                  "--epochs", "40", "--samples", "1536", "--model", "mlp", "--width", "256",
                                  "--snapshot-path", "snaps/"], cwd=tmp_path, env=ddpkit_env(), stdout=f,
                                 stderr=subprocess.STDOUT)
        with killed_if_left(agent):
            wait_until(lambda: list((tmp_path / "snaps").glob("*.pt")) and len(_workers(agent.pid)) == 3, agent, out)
            rank1 = _workers(agent.pid)[1]
            os.kill(rank1, sig)
            code = agent.wait(timeout=240)
    text = out.read_text()
    assert code == 0, text
    decision = next(line for line in text.splitlines() if line.startswith("ddpkit heal: attempt 1 of 3:"))
    how = "stopped answering" if sig == signal.SIGSTOP else "was killed by SIGKILL"
    assert decision.startswith(f"ddpkit heal: attempt 1 of 3: rank 1 on host {HOST} {how} (host fault); "
                               "relaunching"), decision
    first, second = Ledger(tmp_path / "run").ended()
    found = first.classification
    assert found is not None and found.kind is FailureClass.HOST, first
    assert (found.culprit_ranks, found.culprit_hosts) == ((1,), (HOST,)), found
    assert first.action is Action.RETRY and second.exit_code == 0
    assert f"pid {rank1})" in text  # the process signalled here is the rank named (by the watch or the agent)
