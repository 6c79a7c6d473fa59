"""The worker side of ddpkit's launcher and the program's exit: pure parts and single processes, no torch world."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ddpkit.launch import worker
from tests.helpers import ddpkit_env


def test_command_started_at_is_the_agents_start_when_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(worker.LAUNCHED_AT, raising=False)
    own = worker.command_started_at()
    assert own == pytest.approx(worker.process_started_at(), abs=1.0) and own <= time.time()
    monkeypatch.setenv(worker.LAUNCHED_AT, "1234.5")
    assert worker.command_started_at() == 1234.5


PROGRAM = """
import atexit, sys, threading, time
from ddpkit import cli
atexit.register(lambda: print("atexit handler ran"))
returned = threading.Event()
command = cli.main
def main(argv=None):
    try:
        return command(argv)
    finally:
        returned.set()
cli.main = main
def late():  # still at work when main has returned
    returned.wait()
    time.sleep(0.3)
    print("non-daemon thread finished")
if sys.argv[1] == "thread":
    threading.Thread(target=late).start()
sys.argv = ["ddpkit", "env", "--json"]
cli.program()
"""


@pytest.mark.parametrize("case", ["plain", "thread"])
def test_program_exit_keeps_output_atexit_handlers_and_running_threads(case: str) -> None:
    """The prompt exit after main (os._exit) loses nothing: output, atexit handlers, a thread still at work."""
    done = subprocess.run([sys.executable, "-c", PROGRAM, case], capture_output=True, text=True, timeout=60,
                          env=ddpkit_env())
    assert done.returncode == 0, done.stderr
    assert '"launcher"' in done.stdout and done.stdout.rstrip().endswith("atexit handler ran")
    assert ("non-daemon thread finished" in done.stdout) == (case == "thread")


def test_a_late_rendezvous_close_is_not_a_warning_but_other_rendezvous_warnings_stay() -> None:
    import logging

    from ddpkit.launch.failure import quiet_late_rendezvous_close

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("torch.distributed.elastic.rendezvous.dynamic_rendezvous", logging.WARNING, __file__,
                                 1, msg, None, None)

    late = ("The node '10.0.0.2_23827_0' has failed to shutdown the rendezvous 'b6d2ca25' due to an error of type "
            "RendezvousConnectionError.")
    assert not quiet_late_rendezvous_close(record(late))
    assert quiet_late_rendezvous_close(record(late.replace("RendezvousConnectionError", "RendezvousStateError")))
    assert quiet_late_rendezvous_close(record("The node 'x' has joined round 1 of the rendezvous 'b6d2ca25'"))
