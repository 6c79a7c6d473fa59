"""What the watch sends between ranks through the job's store, named and typed (torch elastic's ``_RoleInstanceInfo``
is the model: a dataclass with its serialize / deserialize, never a dict of string keys or a message parsed back out
of its own headline)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["HEADLINE_PREFIX", "AbortOrder", "StoppedRank"]

#: Every line the watch prints about the job starts so; a reason is the same words without it.
HEADLINE_PREFIX = "ddpkit watch: "


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
