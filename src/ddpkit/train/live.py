"""The trainer's half of live healing (``ddpkit train --heal live``): the group re-formed in the same processes
(``ddpkit.live.rank.group``), and what a replica of ``Trainer`` hands a replacement and the ranks behind: model,
optimizer, RNG state, hosts, drills, loss history and the epoch's losses. The position is the step: training goes
on at the source's step's epoch and batch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ddpkit.comm.rng import capture_rng, restore_rng
from ddpkit.live.rank.group import LiveGroup
from ddpkit.train.snapshotter import StartPoint

if TYPE_CHECKING:
    from ddpkit.live.protocol import Plan
    from ddpkit.runtime import Runtime
    from ddpkit.train.faults import DrillBook
    from ddpkit.train.summary import RunSummary

__all__ = ["LiveGroup", "Replica", "join", "rejoin"]


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
    cfg: Any
    snapshots: Any


def join(group: LiveGroup, trainer: Replica) -> StartPoint:
    """In a replacement, before training: take the state of the group's most advanced rank."""
    return _exchange(group, trainer, done=-1)


def rejoin(group: LiveGroup, trainer: Replica, plan: Plan, exc: BaseException, ddp: Any) -> StartPoint:
    """After ``exc`` (``plan``: the peers lost; ``ddp`` the model wrapped over the old group): the next generation's
    group, and where training goes on."""
    group.reform(plan, exc, trainer.rt.device, ddp)
    return _exchange(group, trainer, done=trainer.done_step)


def _exchange(group: LiveGroup, trainer: Replica, *, done: int) -> StartPoint:
    """Take the source's state where this rank is behind; where training goes on."""
    agreed = group.exchange(done, lambda step: _state(trainer, step))
    given, best = agreed.state, agreed.step
    losses = [float(x) for x in trainer.epoch_losses]
    if given is not None:
        trainer.job.model.load_state_dict(given["model"])
        trainer.job.optimizer.load_state_dict(given["optimizer"])
        if done < 0:  # the replacement
            restore_rng(given["rng"])
            # the drills and snapshots of the run, not only this process's part: a drill that fired on the lost rank 0
            # is in its drill book on disk (read at start), a snapshot it wrote is on disk
            trainer.hosts, trainer.drills.fired = list(given["hosts"]), {**given["drills"], **trainer.drills.fired}
            trainer.snapshots.group_paths = list(given["snapshots"])
            if group.rank == 0:
                trainer.snapshots.paths = [p for p in given["snapshots"] if os.path.exists(p)]
            trainer.summary.loss_history = dict(given["loss_history"])
            losses = list(given["epoch_losses"])
        elif done == best - 1 and trainer.pending_loss is not None:  # the step in flight, applied elsewhere
            losses.append(float(trainer.pending_loss.detach()))  # no autograd warning on each such rank
    if group.rank == 0:  # a drill that killed a rank is followed by this resume, at the source's step
        trainer.drills.resumed(best)
    epoch, batch = divmod(best, trainer.steps_per_epoch)
    if batch == 0 and epoch > 0 and (epoch - 1) not in trainer.summary.loss_history and losses:
        trainer.summary.loss_history[epoch - 1] = float(torch.tensor(losses).mean())  # lost after its last step
    return StartPoint(epoch=epoch, batch=batch, step=best, epoch_losses=losses if batch else [],
                      loss_history=trainer.summary.loss_history, missed_snapshot=_missed(group, trainer, epoch, batch))


def _missed(group: LiveGroup, trainer: Replica, epoch: int, batch: int) -> bool:
    """Whether the group goes on at the end of an epoch whose snapshot was due and never reached rank 0 (rank 0 says;
    every rank decides the same, as a snapshot is a collective)."""
    if batch or not trainer.snapshots.enabled or not trainer.cfg.snapshot_due(epoch):
        return False
    taken: list[Any] = [trainer.snapshots.taken if group.rank == 0 else None]
    dist.broadcast_object_list(taken, src=0)
    return bool(taken[0] != epoch * trainer.steps_per_epoch)


def _state(trainer: Replica, step: int) -> dict[str, Any]:
    """What the source hands over: everything a replica holds that the others may lack."""
    return {"step": step, "model": trainer.job.model.state_dict(), "optimizer": trainer.job.optimizer.state_dict(),
            "rng": capture_rng(), "hosts": list(trainer.hosts), "drills": dict(trainer.drills.fired),
            "loss_history": dict(trainer.summary.loss_history), "snapshots": list(trainer.snapshots.group_paths),
            "epoch_losses": [float(x) for x in trainer.epoch_losses]}
