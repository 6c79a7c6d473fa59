"""The one-host supervisor of ``ddpkit run|train -n N --heal``: ddpkit's own agent run once per attempt, each
failed attempt classified (``classify``), recorded in the run's ledger (``ledger``) and acted on (``policy``).

Evidence, gathered without reaching into the agent (``ddpkit.launch`` is not changed for this; the coupling is
two read-only seams, each said where it is used):

- the agent's root-cause lines (``ddpkit.launch.failure.root_cause``: "rank R (pid P) was killed by SIGX first",
  "... failed first with exit code C", "rank(s) ... stopped with exit 3"; ``ddpkit.launch.agent``: "received
  SIGTERM from outside the job"), taken by a ``logging.Handler`` on those two loggers while the attempt runs and
  read from each record's format string and arguments, not from the printed text;
- the per-rank log files that the agent keeps where ``LaunchOptions.log_dir`` is set (``ddpkit.launch.ranklogs``:
  ``LOG_DIR/attempt-N/rank-R.stderr.log``; ``ddpkit run`` writes them): each rank's last traceback, and the watch's
  "rank R on host H ... stopped answering" lines. Where neither exists (``ddpkit train`` prints to the terminal)
  the root-cause line alone decides, and an exit code with no traceback is the class ``unknown``.

If either seam changes shape, the evidence thins and the classes fall back towards ``unknown``, which is retried
within ``--max-attempts``: never worse than no healing. tests/multiproc/test_heal.py holds both seams to account.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.base.errors import EXIT_MISSING, ConfigError, DdpkitError
from ddpkit.base.log import get_logger
from ddpkit.goodput.records import ATTEMPT_VAR, RUN_DIR_VAR
from ddpkit.heal.classify import STOPPED_ANSWERING, Evidence, RankEvidence, WatchReport, classify, exception_line
from ddpkit.heal.ledger import Action, AttemptEnded, AttemptStarted, Ledger, SupervisorStarted
from ddpkit.heal.policy import HealPolicy, Outcome, decide
from ddpkit.process.worker_context import HEAL_SILENT_DEFAULT_S, HEAL_SILENT_S

if TYPE_CHECKING:
    from ddpkit.env import WorldInfo
    from ddpkit.launch.agent import LaunchOptions

__all__ = ["HEALED_COMMANDS", "RUNS_DIR", "supervise"]

log = get_logger(__name__)

#: Where run directories go by default, under the current directory.
RUNS_DIR = ".ddpkit-runs"
#: The commands whose ranks a supervisor may start again: ``check`` and ``bench`` report, they do not retry.
HEALED_COMMANDS = ("run", "train")
#: Read from the end of each rank's stderr log: the traceback and the watch's report are there.
TAIL_BYTES = 64 * 1024


def supervise(world: WorldInfo, args: argparse.Namespace, options_for: Callable[[], LaunchOptions],
              launch_attempt: Callable[[LaunchOptions], int]) -> int:
    """Run attempts (``launch_attempt(options)``: the agent, once) until one succeeds or the policy stops; return
    the run's exit code. ``options_for`` builds the agent's options (after the refusals: it checks -n/-j)."""
    _refuse_unless_one_host(world, args)
    options = options_for()
    if options.shape.max_nodes > 1:  # -j MIN:MAXxP on every host: the hosts that are left go on (heal.elastic)
        from ddpkit.heal.elastic import supervise_across_hosts

        _refuse_restarts(options)
        return supervise_across_hosts(args, options, launch_attempt, progress=newest_snapshot_step,
                                      start_goodput=_start_goodput)
    _refuse_unless_local(options)
    policy = HealPolicy(max_attempts=args.max_attempts)
    run_dir = Path(args.run_dir) if args.run_dir else _new_run_dir()
    ledger = Ledger(run_dir)
    host = socket.gethostname().split(".", 1)[0]
    ranks = options.shape.nproc_per_node
    print(f"ddpkit heal: run directory {run_dir} (ledger {ledger.path.name}); up to {policy.max_attempts} "
          f"attempt(s)", file=sys.stderr, flush=True)
    ledger.append(SupervisorStarted(time=time.time(), pid=os.getpid(), host=host, max_attempts=policy.max_attempts,
                                    command=tuple(getattr(args, "ddpkit_argv", ()))))
    _start_goodput(run_dir, host)
    # a rank whose heartbeat stopped (a stopped or killed process) is a host fault in seconds, not at the hang
    # deadline: every rank stops and the next attempt starts (the watch's silent_stop; a slow rank that answers
    # keeps its heartbeat and is never one)
    os.environ.setdefault(HEAL_SILENT_S, f"{HEAL_SILENT_DEFAULT_S:g}")
    for of_session in range(1, policy.max_attempts + 1):
        attempt = ledger.next_attempt()
        logs = run_dir / f"attempt-{attempt}"
        attempt_options = _with_log_dir(options, logs)
        # the agent writes rank logs for ddpkit run only (LaunchOptions.rank_logs): train's ranks print to the screen
        kept = str(logs) if attempt_options is not options and args.command == "run" else None
        ledger.append(AttemptStarted(attempt=attempt, time=time.time(), hosts=(host,), ranks=ranks, logs=kept))
        os.environ[ATTEMPT_VAR] = str(attempt)  # train's rank 0 writes its goodput lines under this attempt
        with _agent_lines() as lines:
            try:
                code = launch_attempt(attempt_options)
            except BaseException as exc:  # the agent itself failed, or a signal came before it could stop its ranks
                code = _exit_code_of(exc)
                ledger.append(AttemptEnded(attempt=attempt, time=time.time(), exit_code=code, action=Action.STOP,
                                           decision=f"ddpkit heal: attempt {of_session}: the agent ended with "
                                                    f"{type(exc).__name__}: {exc}; stopping",
                                           exit_code_of_run=code))
                raise
        found = classify(gather(code, lines, kept, host)) if code else None
        progress = newest_snapshot_step(args)
        history = ledger.ended()
        decision = decide(policy, history, Outcome(attempt=attempt, of_session=of_session, exit_code=code,
                                                    classification=found, progress=progress))
        if found is not None or of_session > 1:  # a first clean attempt needs no word
            print(decision.line, file=sys.stderr, flush=True)
        ledger.append(AttemptEnded(attempt=attempt, time=time.time(), exit_code=code, action=decision.action,
                                   classification=found, progress=progress, decision=decision.line,
                                   exit_code_of_run=decision.exit_code))
        if decision.action is not Action.RETRY:
            return int(decision.exit_code if decision.exit_code is not None else code)
    raise AssertionError("the policy gives up at --max-attempts")  # decide() never retries the last attempt


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


def gather(code: int, lines: list[logging.LogRecord], logs: str | None, host: str) -> Evidence:
    """The evidence of a failed attempt: the agent's lines (``lines``) and the ranks' stderr logs under ``logs``."""
    ranks: dict[int, RankEvidence] = {}
    outside: str | None = None
    preempted = False
    for record in lines:
        text = str(record.msg)
        args = tuple(str(a) for a in record.args) if isinstance(record.args, tuple) else ()
        if text.startswith("rank %d (pid %d) was killed by %s first") and len(args) >= 3:
            ranks[int(args[0])] = RankEvidence(rank=int(args[0]), host=host, signal=args[2], first=True)
        elif text.startswith("rank %d (pid %d) failed first with exit code %d") and len(args) >= 3:
            ranks[int(args[0])] = RankEvidence(rank=int(args[0]), host=host, exit_code=int(args[2]), first=True)
        elif text.startswith("rank(s) %s stopped with exit %d") and args:
            for word in args[0].split(","):
                if word.strip().isdigit():
                    ranks[int(word)] = RankEvidence(rank=int(word), host=host, exit_code=EXIT_MISSING,
                                                    stopped_by_ddpkit=True)
        elif text.startswith("the workers stopped after a preemption signal"):
            preempted = True
        elif text.startswith("received %s from outside the job") and args:
            outside = args[0]
    watch_lines: list[str] = []
    stopped: dict[int, str] = {}
    for rank, text in _stderr_tails(logs):
        said = exception_line(text)
        for line in text.splitlines():
            if "ddpkit watch:" in line or "stopped answering" in line:
                watch_lines.append(line.strip())
            for match in STOPPED_ANSWERING.finditer(line):
                stopped[int(match.group(1))] = match.group(2)
        if said is None:
            continue
        known = ranks.get(rank) or RankEvidence(rank=rank, host=host)
        ranks[rank] = dataclasses.replace(known, exception=said)
    watch = WatchReport(stopped_answering=tuple(sorted(stopped.items())), hang=any("HANG" in w for w in watch_lines),
                        lines=tuple(dict.fromkeys(watch_lines))[:20]) if watch_lines else None
    return Evidence(exit_code=code, ranks=tuple(ranks.values()), watch=watch, outside_signal=outside,
                    all_preempted=preempted)


def _exit_code_of(exc: BaseException) -> int:
    """The exit code an exception out of the agent leaves the process with (torch's SignalException: 128 + the
    signal, as a process that signal ends)."""
    if isinstance(exc, DdpkitError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    sigval = getattr(exc, "sigval", None)
    return 128 + int(sigval) if sigval is not None else 1


def newest_snapshot_step(args: argparse.Namespace) -> int | None:
    """The run's progress: the global step of the newest snapshot file ``ddpkit train --snapshot-path`` left
    (named ``NAME.<step>.pt``; unverified: the trainer verifies it when it resumes). None for a user's script, or a
    train run without snapshots: its progress is unknown."""
    path = getattr(args, "snapshot_path", None)
    if args.command != "train" or not path:
        return None
    from ddpkit.train.config import snapshot_location
    from ddpkit.train.snapshot import SnapshotDir

    directory, name, ext = snapshot_location(path)
    try:
        found = SnapshotDir(directory, name, ext, keep=1).candidates()
    except OSError:
        return None
    return found[0][0] if found else None


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


#: The agent's loggers whose lines name a failed attempt's root cause (see the module's docstring).
AGENT_LOGGERS = ("ddpkit.launch.failure", "ddpkit.launch.agent")


@contextmanager
def _agent_lines() -> Iterator[list[logging.LogRecord]]:
    handler = _Lines()
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def _stderr_tails(logs: str | None) -> Iterator[tuple[int, str]]:
    """(rank, end of its stderr log) for each rank log the agent kept under ``logs`` (any of its attempts)."""
    if not logs:
        return
    for path in sorted(Path(logs).glob("attempt-*/rank-*.stderr.log")):
        rank = path.name.removeprefix("rank-").removesuffix(".stderr.log")
        if not rank.isdigit():
            continue
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - TAIL_BYTES))
                yield int(rank), f.read().decode(errors="replace")
        except OSError:
            continue


def _with_log_dir(options: LaunchOptions, logs: Path) -> LaunchOptions:
    """The agent keeps each rank's output under ``logs`` where it can (its ``log_dir`` option, for the commands
    whose ranks it logs to files): the supervisor reads their tracebacks from there."""
    if "log_dir" not in {f.name for f in dataclasses.fields(options)}:
        return options
    return dataclasses.replace(options, log_dir=str(logs))  # type: ignore[call-arg,unused-ignore]


def _new_run_dir() -> Path:
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    return Path(RUNS_DIR) / run_id


def _refuse_unless_one_host(world: WorldInfo, args: argparse.Namespace) -> None:
    today = ("ddpkit's own agent: ddpkit run|train -n N --heal on one host, -j MIN:MAXxP --heal on every host; "
             "ddpkit submit mpi --heal")
    later = "a job started by another launcher is healed by the one that submits it (ddpkit submit ... --heal)"
    if world.launcher != "none" or world.is_agent:
        raise ConfigError(f"--heal under {world.launcher}: ddpkit does not start the ranks here, so it cannot "
                          f"start them again", f"--heal where it heals today, {today}; {later}",
                          f"drop --heal, or start the ranks with ddpkit itself: ddpkit {args.command} -n N --heal")
    if args.command not in HEALED_COMMANDS:
        raise ConfigError(f"--heal with ddpkit {args.command}", f"--heal with {' or '.join(HEALED_COMMANDS)}",
                          f"drop --heal: {args.command} reports what it finds and is not retried")
    if args.max_attempts < 1:
        raise ConfigError(f"--max-attempts {args.max_attempts}", "1 or more", "pass --max-attempts 3 (the default)")


def _refuse_unless_local(options: LaunchOptions) -> None:
    shape = options.shape
    if shape.nproc_per_node < 2:
        raise ConfigError("--heal with one rank (no -n)", "-n 2 or more: ddpkit's agent starts the ranks",
                          "add -n N")
    _refuse_restarts(options)


def _refuse_restarts(options: LaunchOptions) -> None:
    if options.max_restarts:
        raise ConfigError(f"--heal with --max-restarts {options.max_restarts}",
                          "one of them: --heal restarts the ranks itself, after classifying each failure",
                          "drop --max-restarts (--max-attempts N bounds --heal's attempts)")
