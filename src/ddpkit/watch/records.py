"""What the watch sends between ranks through the job's store, named and typed (torch elastic's ``_RoleInstanceInfo``
is the model: a dataclass with its serialize / deserialize, never a dict of string keys or a message parsed back out
of its own headline)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

__all__ = ["HEADLINE_PREFIX", "AbortOrder", "Heartbeat", "Phase", "StoppedRank", "Timings", "Waiting"]

#: Every line the watch prints about the job starts so; a reason is the same words without it.
HEADLINE_PREFIX = "ddpkit watch: "


#: The call a rank waits in: the oldest open collective (``bytes`` its size), else the point-to-point call it blocks
#: in (``bytes`` None, ``peers`` its [direction, peer] pairs); ``for``: seconds so far. (A keyword as a key: the
#: functional form.)
_Call = TypedDict("_Call", {"seq": int, "op": str, "bytes": int | None, "site": str, "for": float})


class Waiting(_Call, total=False):
    peers: list[list[Any]]
#: The innermost ``ddpkit.watch.phase()`` a rank is in: its name, seconds so far, and the deadline it declared.
Phase = TypedDict("Phase", {"name": str, "for": float, "deadline": float | None})


class Timings(TypedDict, total=False):
    """Step times (seconds): ``steps`` begun, ``timed`` (one in SAMPLE_EVERY); the percentiles and means once a step
    was timed; the longest step after the first, every step measured, once one ended."""

    steps: int
    timed: int
    step_p50: float
    step_p99: float
    step_mean: float
    sync_samples: int
    sync_p50: float
    sync_mean: float
    step_max: float
    step_max_at: int


class _Later(TypedDict, total=False):
    p2p: dict[str, dict[str, int]]
    """Point-to-point calls posted, by direction and peer, once any was made."""
    counted_as: str
    """Which calls ``group_seq`` counts (DDP's C++ all-reduce, a comm hook's), where it counts any."""
    finished: bool
    """In a rank's last record: it ended well (its script destroyed its process group, or returned 0), so a peer
    that outlives it says it finished, not that it is gone."""


class Heartbeat(_Later):
    """What a rank publishes at every heartbeat (``Recorder.record``, store key ``rec/<rank>``) and the monitor reads:
    who it is, how far it got, what it waits in. A TypedDict, not a dataclass: it crosses the store as JSON twice a
    second on every rank, and its readers take it as it came."""

    rank: int
    host: str
    pid: int
    beat: int
    """Counts up at every heartbeat: a rank whose beat stops changing stopped answering."""
    entered: int
    """Collectives entered (the job's sequence number of the last one)."""
    completed: int
    """Calls that returned, point-to-point ones included: the monitor's measure of progress."""
    step: int
    first_step_done: bool
    recent: list[list[Any]]
    """The last collectives entered: [seq, op, bytes, site]."""
    waiting: Waiting | None
    phase: Phase | None
    stage: list[Any] | None
    """A command's own stage (check's phase and its deadline), where it set one."""
    final: bool
    """The rank's last record: it finished (a finished rank is never a hang)."""
    failed: bool
    group_seq: int | None
    timings: Timings


@dataclass(frozen=True)
class StoppedRank:
    """A rank that stopped answering, and the live rank on its host that ends it (None: no live rank there)."""

    rank: int
    host: str
    pid: int
    by: int | None


@dataclass(frozen=True)
class AbortOrder:
    """Every rank stops (exit 3): why, who said so, and who ends the ranks that cannot end themselves."""

    reporter: int
    """The rank that reported and ordered the stop."""
    reason: str
    """The report's first line, without ``HEADLINE_PREFIX``: what a handler shows (check's verdict, train's message)."""
    stopped: tuple[StoppedRank, ...] = ()
    silent: tuple[int, ...] | None = ()
    """The ranks that stopped answering; None when this rank lost the job's store (it cannot know)."""
    live: int = 1
    """How many ranks still answered: each confirms it saw the order before the reporter leaves."""
    hosts: dict[int, str] = field(default_factory=dict)
    deadline: str | None = None
    """A phase's deadline that passed, in words (``ddpkit check``'s phases), else None."""
    store_lost: str | None = None
    """The store's error when the order comes from a rank that lost it (no other rank sees this order)."""

    @property
    def headline(self) -> str:
        return HEADLINE_PREFIX + self.reason

    @classmethod
    def from_headline(cls, reporter: int, headline: str, **fields: object) -> AbortOrder:
        return cls(reporter=reporter, reason=headline.removeprefix(HEADLINE_PREFIX), **fields)  # type: ignore[arg-type]

    def to_json(self) -> str:
        data = asdict(self)
        data["hosts"] = {str(r): h for r, h in self.hosts.items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> AbortOrder:
        data = json.loads(text)
        silent = data.get("silent")
        return cls(reporter=int(data["reporter"]), reason=str(data["reason"]),
                   stopped=tuple(StoppedRank(**s) for s in data.get("stopped", ())),
                   silent=None if silent is None else tuple(int(r) for r in silent), live=int(data.get("live", 1)),
                   hosts={int(r): str(h) for r, h in data.get("hosts", {}).items()}, deadline=data.get("deadline"),
                   store_lost=data.get("store_lost"))
