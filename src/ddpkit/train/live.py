"""A rank's half of live healing (``ddpkit train --heal live``; the agent's half: ddpkit.launch.live, the protocol
in the agent's store: ddpkit.process.live).

In DDP every replica holds the whole state, so a lost rank's is in every survivor's memory. When a collective fails
because a peer is gone, a survivor keeps its process: it waits for the agent's plan of the next generation, leaves the
broken group and forms the new one with the others and the replacement (a fresh store prefix, the same ranks). Then:

- every rank says how many steps it applied; the source is the lowest rank of those that applied the most. A step in
  flight when the peer was lost was applied on every rank or on none, or (the all-reduce finished on some ranks only)
  on some: those behind take it from the source, so no applied step is lost and none is applied twice;
- the source broadcasts model, optimizer, step, data position and RNG state (and its loss history); the replacement
  and the ranks behind load it; the others keep their own (equal) state, their losses and their RNG;
- DDP is wrapped again over the new group, and training goes on at the step after the source's.

No snapshot is read: snapshots remain what survives the loss of every replica at once.
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ddpkit.base.log import get_logger
from ddpkit.process import live as protocol
from ddpkit.train.rng import capture_rng, restore_rng
from ddpkit.train.snapshotter import StartPoint

if TYPE_CHECKING:
    from ddpkit.process.worker_context import WorkerContext
    from ddpkit.runtime import Runtime
    from ddpkit.train.faults import DrillBook
    from ddpkit.train.summary import RunSummary

__all__ = ["LiveGroup", "peer_lost"]

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


class Replica(Protocol):
    """What live healing reads and sets of a rank's trainer (``ddpkit.train.trainer.Trainer``)."""

    job: Any
    rt: Runtime
    summary: RunSummary
    drills: DrillBook
    hosts: list[str]
    steps_per_epoch: int
    done_step: int
    """The steps this rank applied."""
    epoch_losses: list[Any]
    """This rank's losses of the epoch under way."""
    pending_loss: Any
    """The loss of the step in flight (its forward ran), or None."""


class LiveGroup:
    """This rank's place in a live-healed job: the agent's store, its generation, the group re-formed in it."""

    def __init__(self, context: WorkerContext, *, rank: int, world_size: int, backend: str,
                 timeout: timedelta) -> None:
        master = context.master
        if master is None or context.live_gen is None:
            raise RuntimeError("--heal live needs ddpkit's live agent (MASTER_ADDR, MASTER_PORT, DDPKIT_LIVE_GEN)")
        self.base = dist.TCPStore(master[0], master[1], is_master=False, timeout=timeout, wait_for_workers=False)
        self.rank, self.world, self.backend, self.timeout = rank, world_size, backend, timeout
        self.gen = context.live_gen
        self.joining = self.gen > 0
        """A replacement, until its first step: it joins generation ``gen`` and takes its state from a peer."""
        self.heals = 0

    def store(self) -> dist.Store:
        """The store of this generation's group (``ddpkit.init`` makes the group under it)."""
        return dist.PrefixStore(protocol.group_prefix(self.gen), self.base)

    # ---- a replacement -------------------------------------------------------------------------------------
    def join(self, trainer: Replica) -> StartPoint:
        """In a replacement, before training: take the state of the group's most advanced rank."""
        return self._exchange(trainer, done=-1)

    # ---- a survivor ------------------------------------------------------------------------------------------
    def rejoin(self, trainer: Replica, exc: BaseException) -> StartPoint:
        """After ``exc`` (a peer lost in a collective): the next generation's group, and where training goes on."""
        plan = self._next_plan(exc)
        said = (str(exc).splitlines() or [type(exc).__name__])[0].rsplit("] ", 1)[-1].split(". This")[0][:160]
        log.warning("rank %d: a peer was lost (%s); re-forming the group with rank %d's replacement (generation %d)",
                    self.rank, said, plan.rank, plan.gen)
        self.gen = plan.gen
        dist.destroy_process_group()
        device = trainer.rt.device
        dist.init_process_group(backend=self.backend, store=dist.PrefixStore("pg/", self.store()), rank=self.rank,
                                world_size=self.world, timeout=self.timeout,
                                device_id=device if device.type == "cuda" else None)
        return self._exchange(trainer, done=trainer.done_step)

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

    # ---- both ------------------------------------------------------------------------------------------------
    def _exchange(self, trainer: Replica, *, done: int) -> StartPoint:
        """Agree on the source, take its state where this rank is behind; where training goes on."""
        steps: list[Any] = [None] * self.world
        dist.all_gather_object(steps, done)
        best = max(steps)
        source = steps.index(best)
        behind = tuple(r for r, s in enumerate(steps) if s != best)
        state: list[Any] = [_state(trainer, best) if self.rank == source else None]
        dist.broadcast_object_list(state, src=source)
        given = state[0]
        losses = [float(x) for x in trainer.epoch_losses]
        if self.rank in behind:
            trainer.job.model.load_state_dict(given["model"])
            trainer.job.optimizer.load_state_dict(given["optimizer"])
            if self.joining:
                restore_rng(given["rng"])
                trainer.hosts, trainer.drills.fired = list(given["hosts"]), dict(given["drills"])
                trainer.summary.loss_history = dict(given["loss_history"])
                losses = list(given["epoch_losses"])
            elif done == best - 1 and trainer.pending_loss is not None:  # the step in flight, applied elsewhere
                losses.append(float(trainer.pending_loss))
        self.heals += 1
        if self.rank == 0:  # a drill that killed a rank is followed by this resume, at the source's step
            trainer.drills.resumed(best)
        epoch, batch = divmod(best, trainer.steps_per_epoch)
        if batch == 0 and epoch > 0 and (epoch - 1) not in trainer.summary.loss_history and losses:
            trainer.summary.loss_history[epoch - 1] = float(torch.tensor(losses).mean())  # lost after its last step
        if self.rank == source:
            self.base.set(protocol.joined_key(self.gen), protocol.Joined(
                gen=self.gen, source=source, step=best, behind=behind, at=time.time()).to_json())
        return StartPoint(epoch=epoch, batch=batch, step=best, epoch_losses=losses if batch else [],
                          loss_history=trainer.summary.loss_history)

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


def _state(trainer: Replica, step: int) -> dict[str, Any]:
    """What the source hands over: everything a replica holds that the others may lack."""
    return {"step": step, "model": trainer.job.model.state_dict(), "optimizer": trainer.job.optimizer.state_dict(),
            "rng": capture_rng(), "hosts": list(trainer.hosts), "drills": dict(trainer.drills.fired),
            "loss_history": dict(trainer.summary.loss_history),
            "epoch_losses": [float(x) for x in trainer.epoch_losses]}
