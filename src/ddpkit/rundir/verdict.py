"""The verdict on a failed attempt, as the run's ledger keeps it (``rundir.ledger``): its class and its culprits.
The rules that reach it are the heal wing's (``heal.classify``); the report reads it without them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ddpkit.base.jsonlines import JsonFields

__all__ = ["Classification", "FailureClass"]


class FailureClass(enum.Enum):
    """What a failed attempt says about where the fault is, and so whether another attempt can help."""

    HOST = "host"
    """Something about a host: its ranks were killed by a signal, stopped answering, or were cut off. Retry."""
    JOB = "job"
    """The program itself: a Python exception of its own. Retrying cannot help (one retry at most)."""
    PREEMPTED = "preempted"
    """The scheduler's signal (or 75/76: the workers stopped after one). Stop; the scheduler requeues."""
    UNKNOWN = "unknown"
    """Nothing decides: retried while attempts are left."""


@dataclass(frozen=True, kw_only=True)
class Classification(JsonFields):
    """The verdict on a failed attempt: its class, who is to blame, on what evidence, in one line."""

    kind: FailureClass
    reason: str
    """One line, the cause first: ``rank 1 on host vm was killed by SIGKILL``."""
    culprit_ranks: tuple[int, ...] = ()
    culprit_hosts: tuple[str, ...] = ()
    evidence: tuple[str, ...] = field(default=())
