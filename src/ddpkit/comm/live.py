"""A rank's half of live healing (``--heal live``), for the trainer (``ddpkit.train.live``) and a user's script
(``ddpkit.run.live``) alike; the agent's half is ``ddpkit.launch.live``, the protocol between them
``ddpkit.process.live``.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddpkit.base.errors import first_line
from ddpkit.base.log import get_logger
from ddpkit.process import live as protocol

if TYPE_CHECKING:
    from ddpkit.process.worker_context import WorkerContext

__all__ = ["Exchanged", "LiveGroup", "peer_lost"]

log = get_logger(__name__)

#: How long a survivor waits for the agent's plan after a peer was lost (seconds): the agent decides in well under
#: one; a plan that does not come means the agent is ending the attempt (the restart heal takes over).
PLAN_WAIT_S = 30.0
#: Words of the errors torch raises in a collective whose peer is gone (gloo's and NCCL's).
_LOST_WORDS = ("gloo", "NCCL", "onnection", "imed out", "timeout", "pair closure")


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer is gone (torch's DistBackendError, gloo's errors)."""
    return isinstance(exc, dist.DistBackendError) or (isinstance(exc, RuntimeError)
                                                      and any(word in str(exc) for word in _LOST_WORDS))


@dataclass(frozen=True, kw_only=True)
class Exchanged:
    """What ``exchange`` agreed: the step the group goes on from, the source, and its state where this rank lacked
    it (the replacement, a rank behind), else None."""

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
        self.base = dist.TCPStore(agent[0], agent[1], is_master=False, timeout=timeout, wait_for_workers=False)
        self.host, self.port = master
        self.rank, self.world, self.backend, self.timeout = rank, world_size, backend, timeout
        self.pg_prefix = pg_prefix
        self.gen = context.live_gen
        self.joining = self.gen > 0
        """A replacement, until its first step: it joins generation ``gen`` and takes its state from a peer."""
        self.heals = 0

    def store(self) -> dist.Store:
        """The store of this generation's group, where ``init_process_group`` makes it."""
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout, wait_for_workers=False)

    def reform(self, exc: BaseException, device: torch.device, ddp: Any = None) -> protocol.Plan:
        """After ``exc`` (a peer lost in a collective): the next generation's group, formed with the replacement.
        ``ddp``: the DistributedDataParallel model whose reducer holds the old group (released first)."""
        plan = self._next_plan(exc)
        said = first_line(exc).rsplit("] ", 1)[-1].split(". This")[0][:160]  # gloo's words, without its source path
        log.warning("rank %d: a peer was lost (%s); re-forming the group with rank %d's replacement (generation %d)",
                    self.rank, said, plan.rank, plan.gen)
        self.gen, self.port = plan.gen, plan.port
        # the old group aborted and released: gloo's abort leaves its connections open while anything holds the
        # group (DDP's reducer does), and a survivor blocked on one (its all-reduce waits on this rank) would wait
        # out the group's timeout; freed, the group closes them and that survivor's collective fails at once
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
        for name in ("logger", "reducer", "process_group"):
            if ddp is not None and hasattr(ddp, name):
                delattr(ddp, name)
        gc.collect()
        dist.init_process_group(backend=self.backend, store=dist.PrefixStore(self.pg_prefix, self.store()),
                                rank=self.rank, world_size=self.world, timeout=self.timeout,
                                device_id=device if device.type == "cuda" else None)
        return plan

    def _next_plan(self, exc: BaseException) -> protocol.Plan:
        key = protocol.plan_key(self.gen + 1)
        try:
            self.base.wait([key], timedelta(seconds=PLAN_WAIT_S))
        except (RuntimeError, dist.DistError) as waited:
            raise RuntimeError(f"a peer was lost ({str(exc)[:200]}) and ddpkit's live agent made no plan to replace "
                               f"it within {PLAN_WAIT_S:.0f} s ({waited}): the restart heal takes over") from exc
        plan = protocol.Plan.from_json(self.base.get(key))
        while self.base.check([protocol.plan_key(plan.gen + 1)]):  # lost again before this rank noticed
            plan = protocol.Plan.from_json(self.base.get(protocol.plan_key(plan.gen + 1)))
        return plan

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
        if self.rank == source:
            self.base.set(protocol.joined_key(self.gen), protocol.Joined(
                gen=self.gen, source=source, step=best, behind=behind, at=time.time()).to_json())
        return Exchanged(step=best, source=source, behind=behind, state=state[0] if self.rank in behind else None)

    def first_step(self) -> None:
        """In a replacement, after its first applied step: the agent's line can be written."""
        self.base.set(protocol.first_key(self.gen), repr(time.time()))
        self.joining = False

    def digests(self, model: torch.nn.Module) -> list[str]:
        """Every rank's SHA-256 of its parameters and buffers (equal replicas: equal digests)."""
        h = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        table: list[Any] = [None] * self.world
        dist.all_gather_object(table, h.hexdigest())
        return [str(d) for d in table]
