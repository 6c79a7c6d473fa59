"""A rank's half of live healing (``--heal live``), for the trainer (``ddpkit.train.live``) and a user's script
(``ddpkit.run.live``) alike; the agent's half is ``ddpkit.live.agent.rules``, the protocol between them
``ddpkit.live.protocol``.

In DDP every replica holds the whole state, so a lost rank's is in every survivor's memory. When a collective fails
because a peer is gone, a survivor keeps its process: ``reform`` waits for the agent's plan of the next generation,
leaves the broken group and forms the new one (the same ranks, the generation's own store, which the replacement's
``init_process_group`` finds at MASTER_PORT). Then ``exchange``:

- every rank says how many steps it applied; the source is the lowest rank of those that applied the most. A step in
  flight when the peer was lost was applied on every rank or on none, or (the all-reduce finished on some ranks only)
  on some: those behind take it from the source, so no applied step is lost and none is applied twice;
- the source broadcasts its state (what its caller gives); the replacement and the ranks behind get it.

No snapshot is read: snapshots remain what survives the loss of every replica at once.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddpkit.base.errors import first_line
from ddpkit.base.log import get_logger
from ddpkit.live.protocol import NO_LOSS, Diverged, Joined, LiveStore, Plan
from ddpkit.live.rank.unblock import Unblocker
from ddpkit.watch.actions import replace_hung_with
from ddpkit.watch.store import agent_store

if TYPE_CHECKING:
    from ddpkit.process.worker_context import WorkerContext

__all__ = ["Exchanged", "LiveGroup", "ReplicasDiverged", "clear_frames_of", "equal_line", "keeps_own_weights",
           "state_digest"]

log = get_logger(__name__)

#: How long a rank whose collective failed waits for the agent's word (seconds): the agent answers within a poll or
#: two (a plan where a rank is lost, "no loss" where none is); no word means the agent is ending the attempt.
PLAN_WAIT_S = 30.0
#: How often that wait looks at the store (seconds).
ASK_POLL_S = 0.01
#: In a generation's own store: how many of its survivors have left the old group (the replacements join by
#: ``init_process_group`` alone).
_ARRIVED = "ddpkit-live-arrived"
#: In a generation's own store, beside it: the steps each survivor applied (``_DONE/RANK``), said as it arrives.
_DONE = "ddpkit-live-done"
#: A frame of a generator or coroutine: clearing it would end it.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
#: What a collective whose peer is gone raises: gloo a RuntimeError, NCCL and the store torch's DistError. Its text is
#: never read: the agent, which sees every rank's process, says whether a peer was lost.
_COLLECTIVE_ERRORS = (RuntimeError, dist.DistError)


def clear_frames_of(exc: BaseException) -> None:
    """Clear the locals of every frame ``exc`` (and what it was raised from or during) left, and of their callers up
    to the frame that handles it. A collective of the program's own that failed (``gather_object`` in a snapshot:
    its ``all_gather`` is called with ``group=``) leaves the group in those locals, some in frames the traceback no
    longer shows (the watch takes its wrappers out of it, not out of the callers' chain); a group still referenced
    keeps its connections open after its abort, and a survivor still waiting in it for this rank waited out the
    watch's deadline (60 s) before the restart heal took over. An executing frame, or a generator's, ends the walk."""
    seen: set[int] = set()
    cleared: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        tb = cause.__traceback__
        while tb is not None:  # each entry, not only the innermost: a generator's frame ends its callers' chain
            frame: FrameType | None = tb.tb_frame
            while frame is not None and id(frame) not in cleared and not frame.f_code.co_flags & _SUSPENDABLE:
                caller = frame.f_back
                try:
                    frame.clear()
                except RuntimeError:  # still executing: the handler, and every frame below it
                    break
                cleared.add(id(frame))  # its callers are walked from here: a deeper entry's walk stops at it
                frame = caller
            tb = tb.tb_next
        cause = cause.__cause__ or cause.__context__


class ReplicasDiverged(Exception):
    """The replicas' digests disagreed after a live heal or at the end of the run (``Diverged`` says which)."""

    def __init__(self, verdict: Diverged) -> None:
        super().__init__(verdict.sentence())
        self.verdict = verdict


def state_digest(model: torch.nn.Module, optimizer: Any = None) -> str:
    """SHA-256 of a replica: its parameters and buffers, and its optimizer's state and hyperparameters (the learning
    rate an LR scheduler set is one), in a fixed order; equal replicas have equal digests."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    if optimizer is not None:
        _hash_value(h, optimizer.state_dict())
    return h.hexdigest()


def _hash_value(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(b"T")
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _hash_value(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(b"[")
        for item in value:
            _hash_value(h, item)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


@dataclass(frozen=True, kw_only=True)
class Exchanged:
    """What ``exchange`` agreed: the step the group goes on from, the source, and its state where this rank lacked
    it (a replacement, a rank behind), else None."""

    step: int
    source: int
    behind: tuple[int, ...]
    state: dict[str, Any] | None


class LiveGroup:
    """This rank's place in a live-healed job: the agent's store, its generation, the group re-formed in it.
    ``pg_prefix``: the prefix the group's own keys take in the generation's store (``init_process_group`` with
    ``env://`` uses ``default_pg``; ``ddpkit.init(store=...)`` uses ``pg/``)."""

    def __init__(self, context: WorkerContext, *, rank: int, world_size: int, backend: str, timeout: timedelta,
                 pg_prefix: str) -> None:
        agent, master = context.live_store, context.master
        if agent is None or master is None or context.live_gen is None:
            raise RuntimeError("--heal live needs ddpkit's live agent (MASTER_ADDR, MASTER_PORT, DDPKIT_LIVE_STORE, "
                               "DDPKIT_LIVE_GEN)")
        self.base = agent_store(agent[0], agent[1], timeout)  # the watch's too: one connection a process
        self.keys = LiveStore(self.base)
        self.host, self.port = master
        self.rank, self.world, self.backend, self.timeout = rank, world_size, backend, timeout
        self.pg_prefix = pg_prefix
        self.gen = context.live_gen
        self.joining = self.gen > 0
        """A replacement, until its first step: it joins generation ``gen`` and takes its state from a peer."""
        self.heals = 0
        self.agent = agent
        self.verify_at: int | None = None
        """The step after which the replicas are compared: one step after a heal, so that what a step changes (a
        scheduler's learning rate) has acted."""
        self.asking = False
        """In ``lost_peer`` or re-forming: this rank knows a peer may be lost."""
        self.arrived_at = self.formed_at = 0.0
        """The last heal's hand-over on this rank: when the survivors met at the store, when the group was formed."""
        self.keys.register(rank)  # the agent heals a loss live only where every survivor can re-form
        # a survivor blocked in a collective with ranks whose node went silent: freed once the agent's plan says so
        Unblocker(self.keys, agent[1], rank, lambda: (self.gen, self.asking)).__enter__()
        replace_hung_with(self._name_hung)  # where the watch would stop the job over a hung rank

    def _name_hung(self, pid: int, headline: str) -> None:
        """The watch's word (on its own thread, so on a connection of its own): the rank of ``pid`` is hung."""
        LiveStore(dist.TCPStore(self.agent[0], self.agent[1], is_master=False, timeout=timedelta(seconds=10),
                                wait_for_workers=False)).name_hung(pid, headline)

    def store(self) -> dist.Store:
        """The store of this generation's group, where ``init_process_group`` makes it."""
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout, wait_for_workers=False)

    def lost_peer(self, exc: BaseException) -> Plan | None:
        """After ``exc`` ended this rank's step: the agent's plan where a peer was lost, None where none was (the
        exception is the program's own: raise it). Only a collective's error types are asked about."""
        if not isinstance(exc, _COLLECTIVE_ERRORS):
            return None
        self.asking = True
        self.keys.ask(self.gen, self.rank, type(exc).__name__)
        deadline = time.monotonic() + PLAN_WAIT_S
        while time.monotonic() < deadline:
            plan = self.keys.plan(self.gen + 1)
            if plan is not None:
                while (later := self.keys.plan(plan.gen + 1)) is not None:  # lost again before this rank noticed
                    plan = later
                return plan
            if self.keys.answer(self.gen, self.rank) == NO_LOSS:
                self.asking = False
                return None
            time.sleep(ASK_POLL_S)
        raise RuntimeError(f"a collective failed ({first_line(exc)[:200]}) and ddpkit's live agent said nothing "
                           f"within {PLAN_WAIT_S:.0f} s: the restart heal takes over") from exc

    def reform(self, plan: Plan, exc: BaseException, device: torch.device, ddp: Any = None,
               done: int | None = None) -> bool:
        """After ``exc`` (``plan``: the peers lost): the next generation's group, formed with the replacements.
        ``ddp``: the DistributedDataParallel model whose reducer holds the old group (released first). ``done``: the
        steps this rank applied, where the caller wraps DDP again before ``exchange`` (a script's ``Replica``); then
        the answer says whether this rank's weights must outlive DDP's broadcast from rank 0 (``keeps_own_weights``;
        False without ``done``)."""
        said = first_line(exc).rsplit("] ", 1)[-1].split(". This")[0][:160]  # gloo's words, without its source path
        log.warning("rank %d: rank(s) %s lost (%s); re-forming the group with their replacements (generation %d)",
                    self.rank, ", ".join(map(str, plan.ranks)), said, plan.gen)
        # the old group aborted and released: gloo's abort leaves its connections open while anything holds the
        # group (DDP's reducer does), and a survivor blocked on one (its all-reduce waits on this rank) would wait
        # out the group's timeout; freed, the group closes them and that survivor's collective fails at once
        from torch.distributed.distributed_c10d import _abort_process_group

        from ddpkit.watch import regroup

        regroup(ddp)  # the watch's references to the old group let go too
        _abort_process_group()
        for name in ("logger", "reducer", "process_group"):
            if ddp is not None and hasattr(ddp, name):
                delattr(ddp, name)
        clear_frames_of(exc)
        # the last references gone, the group is freed by its count; the youngest generation is collected for what
        # the failed step left in cycles. A full collection took 0.18 s here (290,000 objects, torch's and the
        # watch's) on the heal's critical path, and freed nothing more: 0 hangs in 26 drills without it
        gc.collect(0)
        # one connection to the generation's store, the one it arrived on: a second one, made as the other survivors
        # made theirs, took 5.0 s to be answered from 8 ranks on this machine (its connect() took 2 ms; the store's
        # first reply came 5 s later, under torch's libuv and legacy servers alike), and the heal 5.4 s, 7.3 s at 32
        # ranks; one connection: 0.3 s and 2.2 s (benchmarks/results/bench_live_heal_growth.md)
        plan, arrived, keep = self._arrive(plan, done)
        self.arrived_at = time.time()
        dist.init_process_group(backend=self.backend, store=dist.PrefixStore(self.pg_prefix, arrived),
                                rank=self.rank, world_size=self.world, timeout=self.timeout,
                                device_id=device if device.type == "cuda" else None)
        self.formed_at = time.time()
        self.asking = False
        return keep

    def _arrive(self, plan: Plan, done: int | None) -> tuple[Plan, dist.Store, bool]:
        """Every survivor of ``plan`` at its generation's store before any forms the group; where a newer plan comes
        first (a rank lost while this one's replacements were joining: the agent replaces them all in the next
        generation), its generation instead. The plan the group is formed in, and this rank's connection to its
        store, and, with ``done`` (every survivor says its steps there and reads the others'), whether this rank
        keeps its weights through DDP's re-wrap (``keeps_own_weights``)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            self.gen, self.port = plan.gen, plan.port
            arrived = self.store()
            if done is not None:
                arrived.set(f"{_DONE}/{self.rank}", str(done))
            arrived.add(_ARRIVED, 1)
            while int(arrived.add(_ARRIVED, 0)) < self.world - len(plan.ranks):
                newer = self.keys.plan(plan.gen + 1)
                if newer is not None:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the survivors of generation {plan.gen} did not all arrive within "
                                       f"{self.timeout.total_seconds():.0f} s: the restart heal takes over")
                time.sleep(ASK_POLL_S)
            else:
                if done is None:
                    return plan, arrived, False
                survivors = [r for r in range(self.world) if r not in plan.ranks]
                said = arrived.multi_get([f"{_DONE}/{r}" for r in survivors])
                steps = {r: int(v) for r, v in zip(survivors, said, strict=True)}
                return plan, arrived, keeps_own_weights(steps, self.rank)
            while (later := self.keys.plan(newer.gen + 1)) is not None:
                newer = later
            log.warning("rank %d: another rank was lost while the replacements joined; re-forming the group with "
                        "rank(s) %s's replacements in generation %d instead", self.rank,
                        ", ".join(map(str, newer.ranks)), newer.gen)
            plan = newer

    def exchange(self, done: int, give: Callable[[int], dict[str, Any]]) -> Exchanged:
        """Agree on the source (``done``: the steps this rank applied; -1 for a replacement); the source's
        ``give(step)`` reaches every rank behind it."""
        steps: list[Any] = [None] * self.world
        dist.all_gather_object(steps, done)
        best = max(steps)
        source = steps.index(best)
        behind = tuple(r for r, s in enumerate(steps) if s != best)
        state: list[Any] = [give(best) if self.rank == source else None]
        dist.broadcast_object_list(state, src=source)
        self.heals += 1
        self.verify_at = best + 1
        if self.rank == source:
            self.keys.joined(Joined(gen=self.gen, source=source, step=best, behind=behind, at=time.time(),
                                    arrived_at=self.arrived_at, formed_at=self.formed_at))
        return Exchanged(step=best, source=source, behind=behind, state=state[0] if self.rank in behind else None)

    def applied(self, step: int, model: torch.nn.Module, optimizer: Any) -> None:
        """After this rank applied ``step``: the replicas compared where a heal is one step old (``verify``); a
        replacement's first step told to the agent, once they agree (its line can be written)."""
        if step == self.verify_at:
            self.verify_at = None
            self.verify(model, optimizer, step=step, where="one step after a live heal")
        if self.joining:
            self.keys.first_step(self.gen)
            self.joining = False

    def digests(self, model: torch.nn.Module, optimizer: Any = None) -> list[str]:
        """Every rank's ``state_digest`` (equal replicas: equal digests)."""
        table: list[Any] = [None] * self.world
        dist.all_gather_object(table, state_digest(model, optimizer))
        return [str(d) for d in table]

    def verify(self, model: torch.nn.Module, optimizer: Any, *, step: int, where: str) -> list[str]:
        """Every rank's digest compared: the digests where they agree; where they do not, rank 0 leaves the verdict
        for the agent and every rank raises ``ReplicasDiverged`` (the attempt ends; the restart heal follows)."""
        digests = self.digests(model, optimizer)
        if len(set(digests)) == 1:
            return digests
        verdict = Diverged(gen=self.gen, step=step, digests=tuple(digests), where=where)
        if self.rank == 0:
            self.keys.diverged(verdict)
        raise ReplicasDiverged(verdict)


def keeps_own_weights(done: dict[int, int], rank: int) -> bool:
    """Whether ``rank``'s weights must outlive DDP's constructor over the re-formed group, which broadcasts rank 0's:
    ``rank`` applied the most steps of the survivors (``done``: each survivor's count) and rank 0 did not (it is
    behind, the step in flight applied elsewhere, or it is a replacement, absent from ``done``). Every rank that
    applied the most keeps its own (the source and the ranks equal to it take nothing in ``exchange``)."""
    best = max(done.values())
    return done[rank] == best and done.get(0, -1) < best


def equal_line(digests: Iterable[str]) -> str:
    """``3 equal (sha256 923565ef8fba)``, or ``3 DIFFER: rank 0 ..., rank 1 ...``: the replicas' line of a live run's
    summary (``train`` and a script's ``Replica`` alike)."""
    table = list(digests)
    if len(set(table)) == 1:
        return f"{len(table)} equal (sha256 {table[0][:12]})"
    return f"{len(table)} DIFFER: " + ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(table))
