"""What the watch is asked to do, and the deadline rule (pure: no torch, no processes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddpkit.errors import ConfigError

__all__ = ["FIRST_STEP_FACTOR", "MIN_HANG_S", "ON_HANG", "SLOWEST_FACTOR", "WatchOptions", "hang_deadline"]

ON_HANG = ("abort", "report")
#: The adaptive deadline's floor (``hang_after`` left unset): a minute with no progress on any rank.
MIN_HANG_S = 60.0
#: The deadline is never shorter than this many times the slowest stretch without progress seen so far.
SLOWEST_FACTOR = 2.0
#: Until every rank has finished its first step (compilation, data loading, DDP's first construction), the deadline
#: is this many times longer: an unmarked slow first step raises no alarm.
FIRST_STEP_FACTOR = 5.0


@dataclass(frozen=True, kw_only=True)
class WatchOptions:
    """How one job is watched (``ddpkit run``'s ``--hang-after``, ``--on-hang``, ``--report-every``, ``--events``)."""

    hang_after: float | None = None
    """Seconds with no progress on any rank (while one waits in a collective) before the hang report. None: adapt:
    at least MIN_HANG_S, and never shorter than SLOWEST_FACTOR x the slowest stretch without progress seen."""
    on_hang: str = "abort"
    """``abort``: after the report every rank stops and the job exits 3 (so the scheduler frees the nodes);
    ``report``: the report only, the job keeps waiting."""
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

    def __post_init__(self) -> None:
        if self.hang_after is not None and not self.hang_after > 0:
            raise ConfigError(f"--hang-after {self.hang_after:g}", "a number of seconds above 0",
                              "pass e.g. --hang-after 120, or leave it out for the adaptive deadline")
        if self.on_hang not in ON_HANG:
            raise ConfigError(f"--on-hang {self.on_hang}", f"one of {', '.join(ON_HANG)}",
                              "pass --on-hang abort (stop every rank, exit 3) or --on-hang report")
        if not self.report_every > 0:
            raise ConfigError(f"--report-every {self.report_every:g}", "a number of seconds above 0",
                              "pass e.g. --report-every 60")
        if not 0 < self.straggler_share < 1:
            raise ConfigError(f"straggler share {self.straggler_share:g}", "a fraction between 0 and 1",
                              "pass e.g. 0.1 (10% of a step)")
        if not 0 < self.heartbeat <= 5:
            raise ConfigError(f"heartbeat {self.heartbeat:g} s", "between 0 and 5 s", "leave it at 0.5")


def hang_deadline(options: WatchOptions, *, slowest_gap: float, first_step_done: bool) -> float:
    """Seconds without progress on any rank that make a hang.

    ``slowest_gap``: the longest stretch without progress seen so far in this job (outside marked phases);
    ``first_step_done``: whether every rank has finished its first step."""
    base = options.hang_after if options.hang_after is not None else MIN_HANG_S
    if options.hang_after is None:
        base = max(base, SLOWEST_FACTOR * slowest_gap)
    return base if first_step_done else base * FIRST_STEP_FACTOR
