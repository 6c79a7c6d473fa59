"""What the supervisor does after an attempt: retry, stop, or give up, and why (``Why``); ``heal.lines`` words it.

Pure: the ledger's history and the new attempt's outcome in, a ``Decision`` out. The rules, in order::

    exit 0                                                    -> stop, 0         (a healthy job is never restarted)
    preempted (the scheduler's signal)                        -> stop, its code  (the scheduler requeues; resume)
    job class, and the attempt before it was job class too    -> stop, 93        (do not requeue)
    N attempts in a row without a newer snapshot (progress)   -> stop, 93        (do not requeue)
    --max-attempts reached                                    -> give up, the attempt's own code
    otherwise (host, unknown, a first job-class failure)      -> retry
    a retry where no attempt can follow (``last``)            -> give up, the attempt's own code

A job-class failure is retried once: a failure that looked like the program's own can still be a host's (a
corrupted page, a flaky file system), and one retry is cheap; a second in a row is not a coincidence. The
no-progress rule counts only attempts whose progress is known: a user's script under ``ddpkit run`` reports none,
and there ``--max-attempts`` alone bounds the attempts. ``--max-attempts`` counts this supervisor's attempts; the
"in a row" rules read the whole ledger, so a requeued job that failed in its own code before the requeue stops
at its next such failure.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.heal.classify import Classification, FailureClass
from ddpkit.rundir.ledger import Action, AttemptEnded

__all__ = ["DEFAULT_MAX_ATTEMPTS", "DEFAULT_NO_PROGRESS_LIMIT", "EXIT_DO_NOT_REQUEUE", "Decision", "HealPolicy",
           "Outcome", "Why", "decide"]

#: The run failed in a way that another attempt cannot mend (its own code twice in a row, or no progress): a
#: scheduler's requeue, or a script that resubmits on failure, should not start it again. NVIDIA's resiliency
#: extension (nvidia-resiliency-ext, ft_launcher) ends with 93 for the same meaning after its
#: ``--ft-max-no-progress-cycles`` restarts without checkpoint progress; ddpkit uses the same number so that
#: wrappers written for one read the other alike. README.md's exit code table lists it.
EXIT_DO_NOT_REQUEUE = 93
DEFAULT_MAX_ATTEMPTS = 3
#: NVIDIA's resiliency extension's default for ``--ft-max-no-progress-cycles``.
DEFAULT_NO_PROGRESS_LIMIT = 3


@dataclass(frozen=True, kw_only=True)
class HealPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    """Attempts one supervisor starts at most (the first included)."""
    no_progress_limit: int = DEFAULT_NO_PROGRESS_LIMIT
    """Failed attempts in a row without a newer snapshot that end the run (where progress is known)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be 1 or more, not {self.max_attempts}")
        if self.no_progress_limit < 1:
            raise ValueError(f"no_progress_limit must be 1 or more, not {self.no_progress_limit}")


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """How the attempt just run ended."""

    attempt: int
    """Its number in the ledger."""
    of_session: int
    """Its number among this supervisor's attempts (1 for the first it started)."""
    exit_code: int
    classification: Classification | None
    """None where the attempt succeeded."""
    progress: int | None = None


class Why(enum.Enum):
    """Which rule decided (``decide``, in its order); ``heal.lines`` words each."""

    COMPLETED = "completed"
    PREEMPTED = "preempted"
    JOB_AGAIN = "job-again"
    """A job-class failure, the second in a row."""
    STALLED = "stalled"
    """``no_progress_limit`` failed attempts in a row without a newer snapshot."""
    NO_ATTEMPT_LEFT = "no-attempt-left"
    """``--max-attempts`` reached."""
    NO_RESTART_LEFT = "no-restart-left"
    """A retry where no attempt can follow (torch elastic's agent has spent its restarts)."""
    RETRY = "retry"


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    exit_code: int | None
    """The run's exit code where the action ends it; None for a retry."""
    why: Why
    stalled: int = 0
    """``Why.STALLED``: the attempts in a row without a newer snapshot."""


def decide(policy: HealPolicy, history: Sequence[AttemptEnded], outcome: Outcome, *, last: bool = False) -> Decision:
    """The action after ``outcome``; ``history``: the ledger's earlier ended attempts, oldest first; ``last``: no
    attempt can follow this one (torch elastic's agent has spent its restarts)."""
    found = outcome.classification
    code = outcome.exit_code
    if code == 0 or found is None:
        return Decision(action=Action.STOP, exit_code=code, why=Why.COMPLETED)
    if found.kind is FailureClass.PREEMPTED:
        return Decision(action=Action.STOP, exit_code=code, why=Why.PREEMPTED)
    if found.kind is FailureClass.JOB and history and history[-1].classification is not None \
            and history[-1].classification.kind is FailureClass.JOB:
        return Decision(action=Action.STOP, exit_code=EXIT_DO_NOT_REQUEUE, why=Why.JOB_AGAIN)
    stalled = attempts_without_progress([*history, outcome])
    if stalled >= policy.no_progress_limit:
        return Decision(action=Action.STOP, exit_code=EXIT_DO_NOT_REQUEUE, why=Why.STALLED, stalled=stalled)
    if outcome.of_session >= policy.max_attempts:
        return Decision(action=Action.GIVE_UP, exit_code=code, why=Why.NO_ATTEMPT_LEFT)
    if last:
        return Decision(action=Action.GIVE_UP, exit_code=code, why=Why.NO_RESTART_LEFT)
    return Decision(action=Action.RETRY, exit_code=None, why=Why.RETRY)


def attempts_without_progress(attempts: Sequence[AttemptEnded | Outcome]) -> int:
    """Failed attempts at the end of ``attempts`` in a row whose progress is known and not newer than the best
    before them. An attempt that reports none (None) neither counts nor breaks the row."""
    best: int | None = None
    row = 0
    for attempt in attempts:
        if attempt.exit_code == 0:
            row = 0
            continue
        if attempt.progress is None:
            continue
        if best is None or attempt.progress > best:
            best, row = attempt.progress, 0
        else:
            row += 1
    return row
