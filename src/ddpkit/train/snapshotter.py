"""The trainer's snapshots, in one component (torchtitan's ``CheckpointManager`` is the model): the directory, the
writer (synchronous, or a background thread with a reusable CPU shadow), the header, and rank 0's decision.

    snapshots = Snapshotter(config, rank=rank, world_size=world, device=device)
    start = snapshots.load(model, optimizer)          # every rank: the same step, or the same error
    ... snapshots.save(model, optimizer, ..., urgent=False)
    snapshots.wait_for_staging()                      # before the next optimizer.step(): the copy is done
    snapshots.close()                                 # the last write is on disk (or its failure raised)

``load``: rank 0 finds the newest snapshot that verifies (reporting and skipping broken ones) and checks it was
made by the same job; it broadcasts that decision, so every rank resumes from the same step or every rank exits
with the same error. Rank 0 loads the model weights before DDP wraps the model (DDP's constructor broadcasts them),
then broadcasts the optimizer state and scatters each rank its own RNG state.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.base.errors import ConfigError
from ddpkit.base.log import get_logger
from ddpkit.comm.rng import capture_rng, restore_rng, seed_everything
from ddpkit.train.config import TrainConfig, snapshot_location
from ddpkit.train.output import say
from ddpkit.train.snapshot import SnapshotDir, read_snapshot, write_snapshot
from ddpkit.train.staging import AsyncWriter, CpuShadow
from ddpkit.train.stops import LastSnapshot
from ddpkit.train.summary import ResumedFrom
from ddpkit.watch import phase as watch_phase

__all__ = ["Snapshotter", "StartPoint"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class StartPoint:
    """Where training starts on this rank, as ``Snapshotter.load`` agreed it with the others."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    """The global step done before the start (the snapshot's)."""
    epoch_losses: list[float] = field(default_factory=list)
    """This rank's losses of the resumed epoch's steps before its (mid-epoch) snapshot."""
    loss_history: dict[int, float] = field(default_factory=dict)
    resumed_from: ResumedFrom | None = None
    skipped: list[str] = field(default_factory=list)
    drills_fired: dict[str, dict[str, Any]] = field(default_factory=dict)
    missed_snapshot: bool = False
    """A live heal resumed at the end of an epoch whose snapshot was due and never reached rank 0 (a peer was lost
    between the epoch's last step and the snapshot): it is taken before training goes on."""


@dataclass(kw_only=True)
class _Decision:
    """Rank 0's decision, broadcast to every rank."""

    error: tuple[str, str, str] | None = None
    header: dict[str, Any] | None = None
    fired: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


class Snapshotter:
    def __init__(self, config: TrainConfig, *, rank: int, world_size: int, device: torch.device) -> None:
        self.cfg, self.rank, self.world, self.device = config, rank, world_size, device
        self.dir: SnapshotDir | None = None
        self.drill_file: Path | None = None
        """Where the drills that fired are remembered (beside the snapshots), or None."""
        if config.snapshot_path is not None:
            directory, name, ext = snapshot_location(config.snapshot_path)
            if rank == 0:  # rank 0 alone reads and writes snapshots; TrainConfig checked that it can create this
                directory.mkdir(parents=True, exist_ok=True)
            self.dir = SnapshotDir(directory, name, ext, config.keep)
            self.drill_file = directory / f"{name}.drills.json"
        self.writer = AsyncWriter()
        self.shadow = CpuShadow()
        self.last = LastSnapshot(configured=self.dir is not None)
        """The newest snapshot this rank knows to exist (rank 0: written; the others: taken together)."""
        self.taken: int | None = None
        """The step of the last snapshot whose state reached rank 0 (being written, or written)."""
        self.stalls: list[float] = []
        """Seconds each save held the training thread (an async one: plus its wait_for_staging)."""
        self.paths: list[str] = []
        self.group_paths: list[str] = []
        """Every snapshot the group took, on every rank (rank 0 writes them): what a replaced rank 0 counts as its
        run's, where they are on disk (``train.live``)."""

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    # ---- load: agree on the snapshot to resume from ------------------------------------------------------
    def _decide(self, model: nn.Module, drills_fired: dict[str, dict[str, Any]]
                ) -> tuple[_Decision, dict[str, Any] | None]:
        """Rank 0: the newest valid snapshot of this job (or an error), as a broadcastable decision."""
        if self.dir is None:
            return _Decision(), None
        self.dir.remove_stale_temps()
        info, skipped = self.dir.newest_valid()
        decision = _Decision(fired=drills_fired, skipped=skipped)
        if info is None:
            return decision, None
        header, state = read_snapshot(info.path)
        found, wanted = header.get("fingerprint", {}), self.cfg.fingerprint()
        diff = {k: (found.get(k), wanted.get(k)) for k in set(found) | set(wanted) if found.get(k) != wanted.get(k)}
        shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
        if not diff and shapes != {k: tuple(v.shape) for k, v in model.state_dict().items()}:
            diff = {"model parameters": ("different names or shapes", "those of this model")}
        if diff:
            listed = "; ".join(f"{k}: snapshot {a!r}, this run {b!r}" for k, (a, b) in sorted(diff.items()))
            decision.error = (f"snapshot {info.path} was written by a different job ({listed})",
                              "a snapshot of the same model and settings",
                              "pass the same options as the run that wrote it, or a new --snapshot-path")
            return decision, None
        decision.header = dict(header, path=str(info.path))
        return decision, state

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer,
             drills_fired: dict[str, dict[str, Any]] | None = None) -> StartPoint:
        """All ranks: agree on a snapshot and restore it everywhere (``drills_fired``: rank 0's record of drills)."""
        decision, state = self._decide(model, drills_fired or {}) if self.rank == 0 else (_Decision(), None)
        box: list[Any] = [decision]
        dist.broadcast_object_list(box, src=0)
        decision = box[0]
        if self.rank == 0:
            for message in decision.skipped:
                say(message)
        if decision.error:
            raise ConfigError(*decision.error)
        header = decision.header
        if header is None:
            seed_everything(self.cfg.seed + self.rank)
            return StartPoint(skipped=decision.skipped, drills_fired=decision.fired)
        if self.rank == 0:
            assert state is not None
            model.load_state_dict(state["model"])
        box = [state["optimizer"] if state is not None else None]
        dist.broadcast_object_list(box, src=0)
        optimizer.load_state_dict(box[0])
        epoch_losses: list[float] = []
        if header["world_size"] == self.world:
            # each rank's RNG states and the losses of the epoch's steps before the snapshot (a mid-epoch one)
            parts = None if state is None else list(zip(state["rng"], state.get("epoch_losses") or [[]] * self.world,
                                                        strict=True))
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, parts, src=0)
            restore_rng(mine[0][0])
            epoch_losses = list(mine[0][1])
        else:
            if self.rank == 0:
                log.warning("snapshot from %d ranks, now %d: RNG states re-seeded (resume is not bitwise exact)%s",
                            header["world_size"], self.world, f"; epoch {header['next_epoch']}'s loss will count "
                            "only the steps after the snapshot" if header["next_batch"] else "")
            seed_everything(self.cfg.seed + self.rank + 7919 * header["global_step"])
        box = [state["loss_history"] if state is not None else {}]
        dist.broadcast_object_list(box, src=0)
        start = StartPoint(epoch=int(header["next_epoch"]), batch=int(header["next_batch"]),
                           step=int(header["global_step"]), epoch_losses=epoch_losses,
                           loss_history={int(k): v for k, v in box[0].items()},
                           resumed_from=ResumedFrom(path=header["path"], epoch=header["next_epoch"],
                                                    batch=header["next_batch"], global_step=header["global_step"]),
                           skipped=decision.skipped, drills_fired=decision.fired)
        self.last = LastSnapshot(configured=True, step=start.step, path=header["path"])
        if self.rank == 0:
            at = f"Epoch {start.epoch}" + (f", step {start.batch}" if start.batch else "")
            say(f"Loading snapshot {header['path']}\nResuming training from snapshot at {at}")
        return start

    # ---- save ------------------------------------------------------------------------------------------
    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, epoch: int, next_epoch: int,
             next_batch: int, step: int, urgent: bool, loss_history: dict[int, float],
             losses: Sequence[torch.Tensor] = ()) -> None:
        """All ranks: gather RNG states to rank 0; rank 0 writes (in the background when configured and not
        ``urgent``). ``losses``: this rank's losses of the epoch so far (a mid-epoch snapshot)."""
        assert self.dir is not None
        t0 = time.perf_counter()
        # with the RNG states, each rank's losses of this epoch so far: a run resumed mid-epoch reports the epoch's
        # loss over all its steps, as an uninterrupted run does
        mine = (capture_rng(), torch.stack(list(losses)).tolist() if losses else [])
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        self.taken = step
        path = self.dir.path_for(step)
        self.group_paths.append(str(path))
        if self.rank != 0:  # rank 0 writes it, synchronously or in the background
            self.last = LastSnapshot(configured=True, step=step, path=f"{path}, written by rank 0")
            return
        # references to the live tensors (parameters and optimizer state change only in optimizer.step());
        # buffers (e.g. BatchNorm statistics) may change in the next forward, so they are cloned now (small)
        params = {p.data_ptr() for p in model.parameters()}
        weights = {k: v if v.data_ptr() in params else v.detach().clone() for k, v in model.state_dict().items()}
        assert parts is not None
        state = {"model": weights, "optimizer": optimizer.state_dict(), "rng": [p[0] for p in parts],
                 "epoch_losses": [p[1] for p in parts], "loss_history": dict(loss_history)}
        header = {"epoch": epoch, "next_epoch": next_epoch, "next_batch": next_batch, "global_step": step,
                  "sampler_epoch": next_epoch, "world_size": self.world, "fingerprint": self.cfg.fingerprint(),
                  "config": self.cfg.as_dict(), "writer_rank": self.rank, "writer_pid": os.getpid(),
                  "created": time.time(), "versions": {"torch": torch.__version__, "ddpkit": ddpkit.__version__,
                                                       "python": sys.version.split()[0]}}
        snapdir = self.dir

        def done() -> None:
            self.last = LastSnapshot(configured=True, step=step, path=str(path))
            snapdir.prune()
            say(f"Epoch {epoch} | Training snapshot saved at {path}")

        # a known long phase for the watch: the other ranks wait in their next collective meanwhile (no alarm)
        with watch_phase("snapshot"):
            self.writer.join()  # the previous write is on disk, and the shadow buffers are free again
            if self.cfg.async_snapshot and not urgent:
                shadow = self.shadow
                # the copy runs on the writer thread while the training thread goes on with the next forward and
                # backward; the trainer calls wait_for_staging() right before the next optimizer.step()
                self.writer.submit(path, lambda: shadow.copy(state), header, after=done)
            else:
                write_snapshot(path, state, header)  # device tensors are copied to host as they are serialised
                done()
        self.stalls.append(time.perf_counter() - t0)
        self.paths.append(str(path))

    def wait_for_staging(self) -> None:
        """Block until an async snapshot's in-memory copy is done (the live tensors may change again)."""
        if self.writer.copying:
            self.stalls[-1] += self.writer.wait_copied()

    def close(self) -> None:
        """Wait for a background write (a snapshot counts once it is on disk); re-raises its failure."""
        self.writer.join()
