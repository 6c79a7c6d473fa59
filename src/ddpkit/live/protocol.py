"""Live healing's protocol between the agent and its workers (``--heal live``), in the agent's TCPStore: one typed
object, ``LiveStore``, that both halves hold (the agent in ``ddpkit.live.agent.rules``, the workers in
``ddpkit.live.rank.group``, a standby in ``ddpkit.standby``), one method a message, and this one key table.

A generation is one process group. The first is 0; each loss (one rank, or several in the same poll) makes the next,
with a replacement for each lost rank:

================================  ============  ============================================================
key                               written by    what it holds
================================  ============  ============================================================
``ddpkit-live/replica/R``         rank R        "1" once it holds a live group: a loss is healed live only
                                                where every survivor does (an unchanged script does not)
``ddpkit-live/ask/G/R``           rank R        its collective failed in generation G: the exception's type
``ddpkit-live/answer/G/R``        the agent     "none": no rank of G is lost, as long as the agent needs to see
                                                one (the rank's own error: raise it)
``ddpkit-live/plan/G``            the agent     once G's replacements are started: a ``Plan``
``ddpkit-live/joined/G``          the source    once every rank of G holds the state: a ``Joined``
``ddpkit-live/first/G``           replacement   after its first applied step (the replicas verified): the time
``ddpkit-live/diverged/G``        rank 0        the replicas' digests disagreed: a ``Diverged``
``ddpkit-live/hung/PID``          the watch     the rank of process PID makes no progress while it runs: the
                                                watch's headline (the agent ends it, and replaces it)
``ddpkit-live/words``             ranks, watch  a count, one more with each question and each rank named hung: the
                                                agent reads the keys above only when it moved
``ddpkit-live/assign/SLOT``       the agent     under Slurm: a standby's variables (JSON), or "" (unused)
``ddpkit-live/proc/SLOT``         a standby     under Slurm: ``{"host": H, "pid": P}``
``ddpkit-live/pulse/SLOT``        its pulse     under Slurm: "COUNT STATE TICKS", every 0.25 s from the rank's
                                                node: the kernel's state of its process (``Seen``)
================================  ============  ============================================================

No torch import: the store is whatever ``torch.distributed.Store`` the caller holds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ddpkit.base.jsonlines import JsonFields

__all__ = ["NO_LOSS", "Diverged", "Joined", "LiveStore", "Plan"]

ROOT = "ddpkit-live/"
#: The agent's answer to a rank whose collective failed while no rank was lost.
NO_LOSS = "none"
_WORDS = f"{ROOT}words"


@dataclass(frozen=True, kw_only=True)
class Plan(JsonFields):
    """The agent's word to the survivors: generation ``gen`` replaces ``ranks`` (lost in the same poll)."""

    gen: int
    ranks: tuple[int, ...]
    why: str
    """``SIGKILL``, ``stopped (SIGSTOP) for 1.0 s``: how the (first) rank was lost."""
    hosts: tuple[str, ...]
    """Each lost rank's host, in the order of ``ranks``."""
    lost_at: float
    """When the agent saw the first of them lost (epoch seconds)."""
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
    arrived_at: float = 0.0
    """When the survivors had all left the old group and met at the generation's store (the source's view)."""
    formed_at: float = 0.0
    """When the new group was formed with the replacements (``init_process_group`` returned on the source)."""

    def record_fields(self) -> dict[str, Any]:
        """What a heal's ledger record (``RankReplaced``) takes from this: the source, the step, the hand-over's
        times (0.0, not said by an older rank, is None there)."""
        return {"source": self.source, "step": self.step, "joined_at": self.at,
                "arrived_at": self.arrived_at or None, "formed_at": self.formed_at or None}


@dataclass(frozen=True, kw_only=True)
class Diverged(JsonFields):
    """The replicas disagreed after a live heal (or at the end of a run that had one): their digests at ``step``."""

    gen: int
    step: int
    digests: tuple[str, ...]
    """Each rank's digest of its weights and optimizer state (rank -> hex)."""
    where: str
    """``after the heal`` or ``at the end``."""

    def groups(self) -> list[tuple[int, ...]]:
        """The ranks that agree, grouped, the largest group first."""
        by: dict[str, list[int]] = {}
        for rank, digest in enumerate(self.digests):
            by.setdefault(digest, []).append(rank)
        return sorted((tuple(r) for r in by.values()), key=lambda g: (-len(g), g))

    def sentence(self) -> str:
        groups = self.groups()
        said = "; ".join(f"rank(s) {', '.join(map(str, g))}: {self.digests[g[0]][:12]}" for g in groups)
        return (f"ddpkit heal: the replicas differ {self.where} (generation {self.gen}, step {self.step}): {said}. "
                "A live heal handed over less than the ranks' loops carry: pass every object with state "
                "(LR scheduler, GradScaler, EMA model, sampler, counters) to live.Replica(model, optimizer, ...)")


class LiveStore:
    """The agent's TCPStore, read and written through the protocol's messages (the module's table)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    @property
    def port(self) -> int:
        return int(self.store.port)

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    # ---- a rank's side ----------------------------------------------------------------------------------------
    def register(self, rank: int) -> None:
        self.store.set(f"{ROOT}replica/{rank}", "1")

    def ask(self, gen: int, rank: int, kind: str) -> None:
        self.store.set(f"{ROOT}ask/{gen}/{rank}", kind)
        self.store.add(_WORDS, 1)

    def answer(self, gen: int, rank: int) -> str | None:
        """The agent's answer to this rank's question in ``gen`` (read once: both keys are then removed)."""
        key = f"{ROOT}answer/{gen}/{rank}"
        if not self._has(key):
            return None
        said = self.store.get(key).decode()
        self.store.delete_key(key)
        self.store.delete_key(f"{ROOT}ask/{gen}/{rank}")
        return str(said)

    def joined(self, joined: Joined) -> None:
        self.store.set(f"{ROOT}joined/{joined.gen}", joined.to_json())

    def first_step(self, gen: int) -> None:
        self.store.set(f"{ROOT}first/{gen}", repr(time.time()))

    def diverged(self, verdict: Diverged) -> None:
        self.store.set(f"{ROOT}diverged/{verdict.gen}", verdict.to_json())

    def name_hung(self, pid: int, headline: str) -> None:
        """The watch's word: the rank of process ``pid`` stopped making progress (its report said why)."""
        self.store.set(f"{ROOT}hung/{pid}", headline)
        self.store.add(_WORDS, 1)

    # ---- the agent's side -------------------------------------------------------------------------------------
    def words(self) -> int:
        """How many words the ranks and the watch have left for the agent (a question, a rank named hung): one read a
        poll, and the keys of each rank read only when it moved (the agent's look stays one store operation while
        nothing is said, whatever the world size)."""
        return int(self.store.add(_WORDS, 0))

    def hung(self, pid: int) -> str | None:
        """The watch's headline where it named the rank of process ``pid`` hung, else None."""
        key = f"{ROOT}hung/{pid}"
        return self.store.get(key).decode() if self._has(key) else None

    def registered(self, rank: int) -> bool:
        return self._has(f"{ROOT}replica/{rank}")

    def asked(self, gen: int, rank: int) -> bool:
        return self._has(f"{ROOT}ask/{gen}/{rank}")

    def say_no_loss(self, gen: int, rank: int) -> None:
        self.store.set(f"{ROOT}answer/{gen}/{rank}", NO_LOSS)

    def put_plan(self, plan: Plan) -> None:
        self.store.set(f"{ROOT}plan/{plan.gen}", plan.to_json())

    def plan(self, gen: int) -> Plan | None:
        key = f"{ROOT}plan/{gen}"
        return Plan.from_json(self.store.get(key)) if self._has(key) else None

    def joined_of(self, gen: int) -> Joined | None:
        key = f"{ROOT}joined/{gen}"
        return Joined.from_json(self.store.get(key)) if self._has(key) else None

    def first_step_of(self, gen: int) -> float | None:
        key = f"{ROOT}first/{gen}"
        return float(self.store.get(key)) if self._has(key) else None

    def diverged_of(self, gen: int) -> Diverged | None:
        key = f"{ROOT}diverged/{gen}"
        return Diverged.from_json(self.store.get(key)) if self._has(key) else None

    # ---- a standby's slot (Slurm) -----------------------------------------------------------------------------
    def assign(self, slot: str, env: dict[str, str] | None) -> None:
        """Give the standby of ``slot`` its rank's variables; None: it is not needed (it ends)."""
        self.store.set(f"{ROOT}assign/{slot}", "" if env is None else json.dumps(env))

    def assign_key(self, slot: str) -> str:
        return f"{ROOT}assign/{slot}"

    def assignment(self, slot: str) -> dict[str, str] | None:
        text = self.store.get(self.assign_key(slot)).decode()
        return dict(json.loads(text)) if text else None

    def say_proc(self, slot: str, host: str, pid: int) -> None:
        self.store.set(f"{ROOT}proc/{slot}", json.dumps({"host": host, "pid": pid}))

    def proc_pid(self, slot: str) -> int | None:
        key = f"{ROOT}proc/{slot}"
        return int(json.loads(self.store.get(key))["pid"]) if self._has(key) else None

    def pulse(self, slot: str, count: int, state: str, ticks: int) -> None:
        """The pulse of ``slot``'s rank (``live.agent.pulse``, on its node): its ``count``-th look at the rank's
        process, the kernel's one-letter ``state`` of it ("" once it is gone) and its CPU ``ticks``."""
        self.store.set(f"{ROOT}pulse/{slot}", f"{count} {state or '-'} {ticks}")

    def pulses(self, slots: list[str]) -> dict[str, tuple[int, str, int] | None]:
        """The last pulse of each of ``slots`` (count, state, ticks; None before the first), in one round trip: each
        slot's key is there from its step's start (``no_pulse_yet``), so the read never waits on a missing one."""
        said = self.store.multi_get([f"{ROOT}pulse/{slot}" for slot in slots]) if slots else []
        found: dict[str, tuple[int, str, int] | None] = {}
        for slot, raw in zip(slots, said, strict=True):
            count, state, ticks = raw.decode().split()
            found[slot] = None if count == "0" else (int(count), "" if state == "-" else state, int(ticks))
        return found

    def no_pulse_yet(self, slot: str) -> None:
        """``slot``'s pulse key, before its step starts: no pulse yet (its pulse counts from 1)."""
        self.pulse(slot, 0, "", 0)
