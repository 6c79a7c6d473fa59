"""The worker side of ddpkit's launcher: what the agent tells its workers, and what they hand back.

The agent exports the variables named here before it starts the workers; the workers (``ddpkit.cli`` on every rank,
``ddpkit.train.cli`` on a preemption) read them. Each name is defined here once. No torch import at module level.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable

from ddpkit.errors import EXIT_PREEMPTED
from ddpkit.log import get_logger

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

#: "1" in every worker of ddpkit's launcher: its -n/-j were already honoured.
LAUNCHED = "DDPKIT_LAUNCHED"
#: When the agent process started (epoch seconds): the command's start, as its workers report it.
LAUNCHED_AT = "DDPKIT_LAUNCHED_AT"
#: A directory where verdict commands' workers leave their exit code (verdict_exit_code, read_verdict).
RESULT_DIR = "DDPKIT_RESULT_DIR"
#: A path a worker that stopped cleanly after a preemption signal creates, so the agent can say so.
PREEMPTED_MARK = "DDPKIT_PREEMPTED_MARK"
#: A directory shared by the agent and its workers about why the workers stop: the agent leaves ``signal`` there
#: (the name of a signal it received from outside the job) before it forwards that signal; a worker that lost its
#: peers leaves ``lost.rank-R`` (its diagnosis) there. See ddpkit.launch.stops.
STOP_DIR = "DDPKIT_STOP_DIR"
#: ``fork`` (default with a CPU build of torch: workers forked from the agent, preloaded modules inherited) or
#: ``spawn`` (fresh processes; always with a CUDA build, see launch.agent._preload).
START_METHOD = "DDPKIT_START_METHOD"


def launched_by_ddpkit() -> bool:
    """True in a worker that ddpkit's own launcher started."""
    return os.environ.get(LAUNCHED) == "1"


def command_started_at() -> float:
    """When the command started, in epoch seconds: its agent's start in a worker of ddpkit's launcher, else this
    process's start (under another launcher, the rank's own start: the launcher's is not known)."""
    try:
        return float(os.environ.get(LAUNCHED_AT, ""))
    except ValueError:
        return process_started_at()


def process_started_at() -> float:
    """When this process started, in epoch seconds (from /proc, to 10 ms, on Linux; elsewhere the time of the call)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: the time of this call
        return time.time()
    return time.time() - max(0.0, age)


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
    from ddpkit import log as ddpkit_log

    # The agent configured logging before its rank existed; configure afresh so lines carry this rank.
    for handler in list(logging.getLogger("ddpkit").handlers):
        logging.getLogger("ddpkit").removeHandler(handler)
    ddpkit_log._configured = False
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # the agent's torch sized its thread pool before the variable was set
        import torch

        torch.set_num_threads(int(threads))
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)
