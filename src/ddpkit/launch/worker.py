"""The worker side of ddpkit's launcher: what the agent tells its workers, and what they hand back.

The agent exports the variables named in ``ddpkit.process.worker_context`` (re-exported here) before it starts the
workers; the workers read them through ``WorkerContext.from_environ()``. No torch import at module level.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

from ddpkit.base.errors import EXIT_PREEMPTED
from ddpkit.base.log import get_logger
from ddpkit.process.exiting import wind_up

# the names the agent and its workers share are defined once, in the bottom layer (train reads them there too)
from ddpkit.process.worker_context import (
    LAUNCHED,
    LAUNCHED_AT,
    PREEMPTED_MARK,
    RESULT_DIR,
    START_METHOD,
    STOP_DIR,
    command_started_at,
    launched_by_ddpkit,
    process_started_at,
)

__all__ = [
    "LAUNCHED",
    "LAUNCHED_AT",
    "PREEMPTED_MARK",
    "RESULT_DIR",
    "START_METHOD",
    "STOP_DIR",
    "command_started_at",
    "die_with_agent",
    "forked_worker",
    "launched_by_ddpkit",
    "process_started_at",
    "read_verdict",
    "run_forked_worker",
    "verdict_exit_code",
]

log = get_logger(__name__)

def verdict_exit_code(code: int) -> int:
    """The exit code for a worker of ddpkit's launcher whose verdict command (check, bench, env) returned ``code``.

    The verdict is left in a file for the agent and the worker exits 0. torch's agent waits for the other nodes'
    agents (its exit barrier) only when its workers succeeded: on a failure the node hosting the rendezvous store
    left at once, and the other nodes, still finishing, lost the store, had their workers stopped and reported a
    rendezvous error instead of their verdict. A verdict is no reason to restart the group either. train keeps the
    failure path: there a non-zero code (a peer is gone) must make the group restart.
    """
    directory = os.environ.get(RESULT_DIR)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if code == EXIT_PREEMPTED or not directory or attempt is None or not attempt.isdigit():
        return code
    name = f"{int(attempt):06d}.rank-{os.environ.get('RANK', '0')}"
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, os.path.join(directory, name))
    except OSError:
        return code
    return 0


def read_verdict(directory: str) -> int:
    """In the agent: the verdict the workers of the last attempt left: the lowest rank's non-zero code, or 0."""
    try:
        names = [n for n in os.listdir(directory) if not n.startswith(".")]
    except OSError:
        return 0
    if not names:
        return 0
    last = max(n.split(".")[0] for n in names)
    codes = []
    for name in (n for n in names if n.startswith(last + ".")):
        with open(os.path.join(directory, name)) as f:
            codes.append((int(name.split("rank-")[1]), int(f.read().strip() or 1)))
    return next((code for _, code in sorted(codes) if code), 0)


def die_with_agent() -> None:
    """In a worker of ddpkit's launcher: have the kernel SIGKILL this process when its agent dies.

    torch starts workers in their own session, so a killed agent (SIGKILL, out of memory, a lost host) leaves
    them running: they hold ports and GPU memory, and keep the other hosts' ranks in a collective that no
    restart can join. Linux only (prctl PR_SET_PDEATHSIG); elsewhere nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if parent == 1 or os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def forked_worker(main: Callable[[list[str]], int]) -> Callable[[list[str]], None]:
    """The entrypoint of a worker forked from the agent: ``main(argv)``, run as ``python -m ddpkit ARGV`` would run
    it. A named function, not a partial: torch's agent reports its entrypoint by ``__name__``."""

    def forked_worker(argv: list[str]) -> None:
        run_forked_worker(main, argv)

    return forked_worker


def run_forked_worker(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """The body of a forked worker: logging set up afresh for its rank, ``main(argv)``, then exit with its code."""
    from ddpkit.base import log as ddpkit_log

    # The agent configured logging before its rank existed; configure afresh so lines carry this rank.
    for handler in list(logging.getLogger("ddpkit").handlers):
        logging.getLogger("ddpkit").removeHandler(handler)
    ddpkit_log._configured = False
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # the agent's torch sized its thread pool before the variable was set
        import torch

        torch.set_num_threads(int(threads))
    code = main(argv)
    # torch's process wrapper ends a forked worker with os._exit: the script's atexit handlers and its open files
    # get what a Python process's exit gives them, here. The work is done: a signal now (the agent ending this rank
    # after another failed) ends the process as it would end Python's exit, not as the agent's inherited handler
    # does (an exception raised inside an atexit handler, its traceback printed under the job's own message)
    _default_signals()
    wind_up()
    _exit_once_returned()
    if code:
        sys.exit(code)


def _exit_once_returned() -> None:
    """A forked worker that finished leaves once its return value is handed back, as a worker torchrun starts
    leaves when its script ends. torch's wrapper (``elastic.multiprocessing.api._wrap``) puts the value in a
    SimpleQueue (written to the pipe at once, read by the agent after this process exits too), then waits for an
    event that the agent sets only when every worker has finished. Kept alive so, a finished rank keeps its
    sockets open: a peer still in a collective with it (one extra all-reduce, a recv) waited forever instead of
    failing at once ("Connection closed by peer"), and the job hung. The event's wait is made to return at once in
    this process (a forked copy: the agent's own event is untouched)."""
    frame = sys._getframe(1)
    while frame is not None:
        event = frame.f_locals.get("queue_finished_reading_event") if frame.f_code.co_name == "_wrap" else None
        if event is not None:
            event.wait = _returned  # an instance attribute: this process's copy only
            return
        frame = frame.f_back  # type: ignore[assignment]
    log.debug("torch's worker wrapper not found: this worker leaves when every worker has finished")


def _returned(timeout: float | None = None) -> bool:
    return True


def _default_signals() -> None:
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
