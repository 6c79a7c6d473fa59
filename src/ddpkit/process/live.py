"""Live healing's protocol between the agent and its workers (``--heal live``), in the agent's TCPStore: both halves
read it here, the agent in ``ddpkit.launch.live``, the workers in ``ddpkit.train.live``.

A generation is one process group. The first is 0; each lost rank makes the next, with a replacement for it:

================================  ==========================================================================
``ddpkit-live/plan/G``            the agent, once G's replacement is started: a ``Plan`` (who was lost, why,
                                  the port of G's own store, where its group is formed)
``ddpkit-live/joined/G``          the rank that gave its state, once every rank holds it: a ``Joined``
``ddpkit-live/first/G``           the replacement, after its first applied step: the time (a float)
================================  ==========================================================================

Under Slurm each rank's process (``ddpkit.standby``) has a slot of its own: ``assign/SLOT``, ``proc/SLOT`` and
``beat/SLOT`` (that module says what they hold).

No torch import: the agent reads the keys with the store it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.base.jsonlines import JsonFields

__all__ = ["SLOT_KINDS", "Joined", "Plan", "first_key", "joined_key", "plan_key", "slot_key"]

ROOT = "ddpkit-live/"


def plan_key(gen: int) -> str:
    return f"{ROOT}plan/{gen}"


def joined_key(gen: int) -> str:
    return f"{ROOT}joined/{gen}"


def first_key(gen: int) -> str:
    return f"{ROOT}first/{gen}"


#: The keys of a rank's process under Slurm (``ddpkit.standby``, which says what each holds).
SLOT_KINDS = ("assign", "proc", "beat")


def slot_key(kind: str, slot: str) -> str:
    """``ddpkit-live/KIND/SLOT``: ``kind`` one of ``SLOT_KINDS``."""
    if kind not in SLOT_KINDS:
        raise ValueError(f"slot key kind {kind!r}: one of {', '.join(SLOT_KINDS)}")
    return f"{ROOT}{kind}/{slot}"


@dataclass(frozen=True, kw_only=True)
class Plan(JsonFields):
    """The agent's word to the survivors: generation ``gen`` replaces ``rank``."""

    gen: int
    rank: int
    why: str
    """``SIGKILL``, ``stopped (SIGSTOP) for 1.0 s``: how the rank was lost."""
    host: str
    lost_at: float
    """When the agent saw it lost (epoch seconds)."""
    port: int
    """The generation's own store (on the agent's host): a group's keys are never those of an earlier one."""


@dataclass(frozen=True, kw_only=True)
class Joined(JsonFields):
    """What the rank that gave its state says once the group of ``gen`` holds it."""

    gen: int
    source: int
    """The rank whose memory the others took (the lowest of those that applied the most steps)."""
    step: int
    """The global step the group goes on from (every step up to it applied)."""
    behind: tuple[int, ...] = ()
    """Survivors that had not applied ``step`` (the step in flight): they took it from the source."""
    at: float = 0.0
    """When every rank held the state (epoch seconds)."""
