"""What the watch is asked to do, and the deadline rule (pure: no torch, no processes)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ddpkit.base.errors import ConfigError
from ddpkit.watch.records import Heartbeat

__all__ = [
    "FIRST_STEP_FACTOR",
    "MIN_HANG_S",
    "MIN_SILENT_S",
    "MIN_STOP_S",
    "ON_HANG",
    "SLOWEST_FACTOR",
    "WatchOptions",
    "add_arguments",
    "hang_deadline",
    "made_a_step",
    "options_from_args",
    "stop_deadline",
]

ON_HANG = ("abort", "report")
#: The adaptive deadline's floor (``hang_after`` left unset): a minute with no progress on any rank.
MIN_HANG_S = 60.0
#: The deadline is never shorter than this many times the slowest stretch without progress seen so far.
SLOWEST_FACTOR = 2.0
#: Until the job has made a step (no rank has finished its first: compilation, data loading, DDP's first
#: construction), the deadline is this many times longer: an unmarked slow first step raises no alarm. Once any rank
#: has finished one, a fault at step 2 is judged as one at step 300 (``made_a_step``).
FIRST_STEP_FACTOR = 5.0
#: Under ``--on-hang abort`` with neither ``stop_after`` nor ``hang_after`` given, every rank stops only after this
#: long without progress (and never before the report): a healthy job pauses for minutes (rank 0 alone writing a
#: checkpoint or evaluating while the others wait in the next collective). torch's own collective timeouts are 10
#: min (NCCL) and 30 min (gloo); NVIDIA's resiliency extension uses heartbeat timeouts of 5 to 45 min.
MIN_STOP_S = 600.0
#: The shortest ``silent_stop``: a heartbeat unchanged for ``monitor.STALE_S`` (3 s) is stale; a little more than that.
MIN_SILENT_S = 4.0


@dataclass(frozen=True, kw_only=True)
class WatchOptions:
    """How one job is watched (``ddpkit run``'s ``--hang-after``, ``--stop-after``, ``--on-hang``,
    ``--report-every``, ``--events``). Seconds are finite and above 0 (``inf`` would turn a check off)."""

    hang_after: float | None = None
    """Seconds with no progress on any rank (while one waits in a collective) before the hang report. None: adapt:
    at least MIN_HANG_S, and never shorter than SLOWEST_FACTOR x the slowest stretch without progress seen."""
    stop_after: float | None = None
    """Under ``abort``: seconds with no progress on any rank before every rank stops (never before the report).
    None: at the report when ``hang_after`` is given, else ``max(MIN_STOP_S, the report's deadline)``."""
    on_hang: str = "abort"
    """``abort``: the report, then every rank stops and the job exits 3 (so the scheduler frees the nodes) once
    ``stop_after`` passed without progress; ``report``: the report only, the job keeps waiting."""
    report_every: float = 60.0
    """Seconds between straggler checks (a line only when one rank or host makes the others wait)."""
    straggler_share: float = 0.10
    """A straggler is named when the others wait for it more than this share of a step."""
    events: Path | None = None
    """A file that receives one JSON line per report (hang, straggler, summary); None: stderr only."""
    summary: bool = True
    """Print the per-rank and per-host step-time summary when the process group is destroyed (or at exit)."""
    heartbeat: float = 0.5
    """Seconds between two publications of a rank's progress in the job's store."""
    goodput: Path | None = None
    """The run directory: this rank's DDP steps as goodput lines there (``watch.steplines``; ``ddpkit run``'s
    ``--run-dir``, or its heal supervisor's). None: none written."""
    silent_stop: float | None = None
    """Under ``--heal`` (a supervisor will start the job again without the bad host): a rank whose heartbeat has not
    changed for this long (stopped, killed, its host cut off) stops every rank at once, naming it, instead of at the
    hang deadline. A rank that is slow but answering never trips it. None: off (the supervisor sets it through
    ``DDPKIT_HEAL_SILENT_S``, ddpkit.process.worker_context.HEAL_SILENT_S)."""

    def __post_init__(self) -> None:
        # inf would turn the watch off without a word, nan compares false with everything
        if self.hang_after is not None and not _seconds(self.hang_after):
            raise ConfigError(f"--hang-after {self.hang_after:g}", "a finite number of seconds above 0",
                              "pass e.g. --hang-after 120, or leave it out for the adaptive deadline")
        if self.stop_after is not None and not _seconds(self.stop_after):
            raise ConfigError(f"--stop-after {self.stop_after:g}", "a finite number of seconds above 0",
                              f"pass e.g. --stop-after 1800, or leave it out ({MIN_STOP_S:g} s at least)")
        if self.on_hang not in ON_HANG:
            raise ConfigError(f"--on-hang {self.on_hang}", f"one of {', '.join(ON_HANG)}",
                              "pass --on-hang abort (stop every rank, exit 3) or --on-hang report")
        if self.stop_after is not None and self.on_hang == "report":
            raise ConfigError(f"--stop-after {self.stop_after:g} with --on-hang report",
                              "--stop-after only under --on-hang abort (report never stops the job)",
                              "leave out --stop-after, or pass --on-hang abort")
        if not _seconds(self.report_every):
            raise ConfigError(f"--report-every {self.report_every:g}", "a finite number of seconds above 0",
                              "pass e.g. --report-every 60")
        if not 0 < self.straggler_share < 1:
            raise ConfigError(f"straggler share {self.straggler_share:g}", "a fraction between 0 and 1",
                              "pass e.g. 0.1 (10% of a step)")
        if self.silent_stop is not None and not (_seconds(self.silent_stop) and self.silent_stop >= MIN_SILENT_S):
            raise ConfigError(f"silent stop after {self.silent_stop:g} s", f"a finite number of seconds, at least "
                              f"{MIN_SILENT_S:g} (a heartbeat is stale after 3 s)", "leave it at 10")
        if not 0 < self.heartbeat <= 5:
            raise ConfigError(f"heartbeat {self.heartbeat:g} s", "between 0 and 5 s", "leave it at 0.5")


def made_a_step(records: Iterable[Heartbeat | None]) -> bool:
    """Whether the job has made a step: some rank's record (the reader's own included) says it finished its first.
    In synchronous DDP no rank finishes a step that the others have not all-reduced with it, so one rank's word is the
    job's; a rank that stopped answering early (its record published before its first step) says nothing against it."""
    return any(rec is not None and rec["first_step_done"] for rec in records)


def hang_deadline(options: WatchOptions, *, slowest_gap: float, first_step_done: bool) -> float:
    """Seconds without progress on any rank that make a hang.

    ``slowest_gap``: the longest stretch without progress seen so far in this job (outside marked phases);
    ``first_step_done``: whether the job has made a step (``made_a_step``): FIRST_STEP_FACTOR times longer until
    then."""
    base = options.hang_after if options.hang_after is not None else MIN_HANG_S
    if options.hang_after is None:
        base = max(base, SLOWEST_FACTOR * slowest_gap)
    return base if first_step_done else base * FIRST_STEP_FACTOR


def stop_deadline(options: WatchOptions, *, report_deadline: float) -> float | None:
    """Seconds without progress on any rank after which every rank stops (exit 3); never before the report
    (``report_deadline``: what ``hang_deadline`` gave). None: never (``on_hang="report"``).

    A given ``hang_after`` with no ``stop_after`` keeps its meaning: report and stop at once."""
    if options.on_hang == "report":
        return None
    if options.stop_after is not None:
        return max(options.stop_after, report_deadline)
    if options.hang_after is not None:
        return report_deadline
    return max(MIN_STOP_S, report_deadline)


def _seconds(value: float) -> bool:
    return math.isfinite(value) and value > 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The watch's options, for ``ddpkit run`` (and ``python -m ddpkit.watch``, its other name)."""
    parser.add_argument("--hang-after", type=float, default=None, metavar="S",
                        help="seconds with no progress on any rank before the hang report (default: adaptive, "
                             "at least 60 s and twice the slowest stretch seen; x5 until the job's first step ends); "
                             "given without --stop-after, every rank also stops then")
    parser.add_argument("--stop-after", type=float, default=None, metavar="S",
                        help="under --on-hang abort: seconds with no progress on any rank before every rank stops "
                             f"(exit 3), never before the report (default: {MIN_STOP_S:g} s, or the report's "
                             "deadline when longer; with --hang-after alone: at the report)")
    parser.add_argument("--on-hang", choices=ON_HANG, default="abort",
                        help="abort: report, then every rank stops (exit 3) after --stop-after; report: report "
                             "and keep waiting")
    parser.add_argument("--report-every", type=float, default=60.0, metavar="S",
                        help="seconds between straggler checks (default 60)")
    parser.add_argument("--events", type=Path, default=None, metavar="PATH",
                        help="append one JSON line per report (hang, straggler, summary) to PATH")


def options_from_args(args: argparse.Namespace) -> WatchOptions:
    """The watch's options from ``add_arguments``' flags; ConfigError for a bad value (pure: a parent process
    checks them before any rank starts)."""
    from ddpkit.goodput.records import run_dir_from_environ

    run_dir = run_dir_from_environ() or getattr(args, "run_dir", None)  # the heal supervisor's, else --run-dir
    return WatchOptions(hang_after=args.hang_after, stop_after=args.stop_after, on_hang=args.on_hang,
                        report_every=args.report_every, events=args.events,
                        goodput=Path(run_dir) if run_dir else None)
