"""The one-host supervisor of ``ddpkit run|train -n N --heal``: ddpkit's own agent run once per attempt, each
failed attempt classified (``classify``), recorded in the run's ledger (``ledger``) and acted on (``policy``).

Evidence, as values from their sources, never read back from a line ddpkit printed:

- the attempt's typed result (``ddpkit.launch.result.AttemptResult``, what ``launch()`` returns, as torch
  elastic's ``RunResult``): torch's per-rank failures (rank, pid, exit code or signal), a signal from outside
  the job, and the watch's abort orders, which name the ranks that stopped answering and their hosts;
- under ``ddpkit run``, the per-rank log files the agent keeps (``LaunchOptions.log_dir``,
  ``LOG_DIR/attempt-N/rank-R.stderr.log``): each rank's last Python traceback, as Python printed it.

An attempt the agent returned from without a result is judged from the logs alone (the class ``unknown`` where they
say nothing, retried within ``--max-attempts``: never worse than no healing); one it raised from stops the run.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.base.errors import ConfigError
from ddpkit.base.log import get_logger
from ddpkit.goodput.records import ATTEMPT_VAR, RUN_DIR_VAR
from ddpkit.heal.attempts import Adapter, Attempts, Ended, LiveHook
from ddpkit.heal.gather import gather
from ddpkit.heal.lines import Style
from ddpkit.heal.policy import HealPolicy
from ddpkit.heal.progress import newest_snapshot_step
from ddpkit.heal.request import HealRequest
from ddpkit.process.worker_context import HEAL_SILENT_DEFAULT_S, HEAL_SILENT_S
from ddpkit.rundir import RunDir
from ddpkit.rundir.ledger import Ledger, SupervisorStarted

if TYPE_CHECKING:
    from ddpkit.env import WorldInfo
    from ddpkit.heal.request import LaunchAttempt
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.live.agent.host import _Forker

__all__ = ["HEALED_COMMANDS", "supervise"]

log = get_logger(__name__)

#: Where run directories go by default, under the current directory.
#: The commands whose ranks a supervisor may start again: ``check`` and ``bench`` report, they do not retry.
HEALED_COMMANDS = ("run", "train")


def supervise(world: WorldInfo, request: HealRequest, options_for: Callable[[], LaunchOptions],
              launch_attempt: LaunchAttempt, fork_for: Callable[[LaunchOptions], _Forker] | None = None) -> int:
    """Run attempts (``launch_attempt(options, live)``: the agent, once; ``live``: the attempt's ``LiveHook`` under
    ``--heal live``, else None) until one succeeds or the policy stops; return
    the run's exit code. ``options_for`` builds the agent's options (after the refusals: it checks -n/-j);
    ``fork_for``: under ``--heal live`` across hosts, this host's rank forker (``live.agent.host.fork_ranks``)."""
    pod = request.live and world.launcher == "kubeflow"  # a pod of submit k8s --heal live: ddpkit is its agent
    if not pod:
        _refuse_unless_one_host(world, request)
    options = options_for()
    if pod and options.shape.max_nodes < 2:
        _refuse_unless_one_host(world, request)
    _refuse_standby_unless_live_across_hosts(request, options)
    if request.live and options.shape.max_nodes > 1 and fork_for is not None:
        from ddpkit.heal.live_hosts import supervise_live_hosts

        return supervise_live_hosts(request, options, fork_for, _start_goodput)
    _refuse_live_unless_one_host(request, options)
    if options.shape.max_nodes > 1:  # -j MIN:MAXxP on every host: the hosts that are left go on (heal.elastic)
        from ddpkit.heal.elastic import supervise_across_hosts

        _refuse_restarts(options)
        return supervise_across_hosts(request, options, launch_attempt, progress=newest_snapshot_step,
                                      start_goodput=_start_goodput)
    _refuse_unless_local(options)
    policy = HealPolicy(max_attempts=request.max_attempts)
    run_dir = Path(request.run_dir) if request.run_dir else _new_run_dir()
    ledger = Ledger(run_dir)
    host = socket.gethostname().split(".", 1)[0]
    print(f"ddpkit heal: run directory {run_dir} (ledger {ledger.path.name}); up to {policy.max_attempts} "
          f"attempt(s)", file=sys.stderr, flush=True)
    ledger.append(SupervisorStarted(time=time.time(), pid=os.getpid(), host=host, max_attempts=policy.max_attempts,
                                    command=request.argv))
    _start_goodput(run_dir, host)
    # a rank whose heartbeat stopped (a stopped or killed process) is a host fault in seconds, not at the hang
    # deadline: every rank stops and the next attempt starts (the watch's silent_stop; a slow rank that answers
    # keeps its heartbeat and is never one)
    os.environ.setdefault(HEAL_SILENT_S, f"{HEAL_SILENT_DEFAULT_S:g}")
    attempts = Attempts(ledger=ledger, policy=policy, style=Style.ONE_HOST, here=host)
    agent = _AgentAttempts(request, options, launch_attempt, RunDir(run_dir), host, ledger)
    return attempts.run(agent, ranks_per_host=options.shape.nproc_per_node)


class _AgentAttempts(Adapter):
    """ddpkit's agent, once per attempt: it keeps each rank's output under the attempt's directory (where the
    ranks' tracebacks are read from; for ``ddpkit run`` only: train's ranks print to the screen) and hands over its
    typed result."""

    style = Style.ONE_HOST

    def __init__(self, request: HealRequest, options: LaunchOptions,
                 launch_attempt: LaunchAttempt, run_dir: RunDir, host: str,
                 ledger: Ledger) -> None:
        self.request, self.options, self.launch_attempt = request, options, launch_attempt
        self.run_dir, self.host, self.ledger = run_dir, host, ledger

    def logs(self, attempt: int) -> str | None:
        return str(self.run_dir.attempt(attempt)) if self.request.keeps_rank_logs else None

    def start(self, attempt: int, of_session: int, hosts: tuple[str, ...], heard: LiveHook) -> Ended:
        options = dataclasses.replace(self.options, log_dir=str(self.run_dir.attempt(attempt)))
        os.environ[ATTEMPT_VAR] = str(attempt)  # train's rank 0 writes its goodput lines under this attempt
        # --heal live: a lost rank is replaced within the attempt (ddpkit.live.agent), each heal told to ``heard``
        result = self.launch_attempt(options, heard if self.request.live else None)
        if not result.exit_code:
            return Ended(exit_code=0)
        return Ended(exit_code=result.exit_code, evidence=gather(result.exit_code, result, self.logs(attempt),
                                                                 self.host))

    def progress(self) -> int | None:
        return newest_snapshot_step(self.request.progress_path)


def _start_goodput(run_dir: Path, host: str) -> None:
    """The goodput ledger's first line (this process's start: its imports count as start-up), and the run
    directory told to the ranks (``DDPKIT_RUN_DIR``, ``DDPKIT_ATTEMPT``: ddpkit/goodput/records.py)."""
    from ddpkit.goodput.records import GOODPUT, RunStarted, append_line, to_json
    from ddpkit.process.worker_context import process_started_at

    before = os.environ.get(RUN_DIR_VAR)
    if before and Path(before).resolve() != run_dir.resolve():
        log.warning("%s was %s; the ranks write their goodput lines to this run's directory, %s", RUN_DIR_VAR,
                    before, run_dir)
    os.environ[RUN_DIR_VAR] = str(run_dir)
    fd = os.open(run_dir / GOODPUT, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_line(fd, to_json(RunStarted(time=process_started_at(), pid=os.getpid(), host=host)))
    finally:
        os.close(fd)


def _new_run_dir() -> Path:
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    return RunDir.default(run_id).path


def _refuse_unless_one_host(world: WorldInfo, request: HealRequest) -> None:
    today = ("ddpkit's own agent: ddpkit run|train -n N --heal on one host, -j MIN:MAXxP --heal on every host; "
             "ddpkit submit mpi --heal")
    later = "a job started by another launcher is healed by the one that submits it (ddpkit submit ... --heal)"
    if world.launcher != "none" or world.is_agent:
        raise ConfigError(f"--heal under {world.launcher}: ddpkit does not start the ranks here, so it cannot "
                          f"start them again", f"--heal where it heals today, {today}; {later}",
                          f"drop --heal, or start the ranks with ddpkit itself: ddpkit {request.command} -n N --heal")
    if request.command not in HEALED_COMMANDS:
        raise ConfigError(f"--heal with ddpkit {request.command}", f"--heal with {' or '.join(HEALED_COMMANDS)}",
                          f"drop --heal: {request.command} reports what it finds and is not retried")
    if request.max_attempts < 1:
        raise ConfigError(f"--max-attempts {request.max_attempts}", "1 or more", "pass --max-attempts 3 (the default)")


def _refuse_standby_unless_live_across_hosts(request: HealRequest, options: LaunchOptions) -> None:
    if request.standby and not (request.live and options.shape.max_nodes > 1):
        raise ConfigError(f"--standby with --heal {'live' if request.live else 'restart'} and "
                          f"{f'-j {options.shape}' if options.shape.max_nodes > 1 else 'one host'}",
                          "--standby with -j NxP --rdzv-endpoint HOST:PORT --heal live: a standby host takes the "
                          "ranks of a host lost", "drop --standby, or add --heal live and -j NxP")


def _refuse_live_unless_one_host(request: HealRequest, options: LaunchOptions) -> None:
    """Across hosts, live healing needs this host's rank forker (``fork_for``: ``ddpkit run|train`` hands it over);
    a caller that gave none cannot heal live there."""
    if request.live and options.shape.max_nodes > 1:
        raise ConfigError(f"--heal live with -j {options.shape} and no way to fork this host's ranks",
                          "ddpkit run|train -j NxP --rdzv-endpoint HOST:PORT --heal live on every host (its own "
                          "agent forks the ranks), or -n N on one host", "start the job with ddpkit run|train")


def _refuse_unless_local(options: LaunchOptions) -> None:
    shape = options.shape
    if shape.nproc_per_node < 2:
        raise ConfigError(f"--heal with one rank on this host (-n 1, -j {shape}, or neither -n nor -j given)",
                          "-n 2 or more: --heal on one host relaunches a group of 2 or more ranks started by "
                          "ddpkit's agent", "pass -n 2 or more, or drop --heal")
    _refuse_restarts(options)


def _refuse_restarts(options: LaunchOptions) -> None:
    if options.max_restarts:
        raise ConfigError(f"--heal with --max-restarts {options.max_restarts}",
                          "one of them: --heal restarts the ranks itself, after classifying each failure",
                          "drop --max-restarts (--max-attempts N bounds --heal's attempts)")
