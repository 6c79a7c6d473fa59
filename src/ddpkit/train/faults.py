"""Faults the trainer survives: preemption signals, Slurm requeue, and drills that inject a fault once on purpose.

Preemption: the handler only sets a flag, and the flag travels with the gradients: the watch is the rider of the
gradient averaging hook (``comm/gradients.py``), which appends it to the last gradient bucket's reduction (one
extra number; no extra collective, no extra round trip). When backward returns, every rank holds the same sum of
flags, so all ranks stop after the same step, even when the signal reached a single rank, and none is left waiting
in a collective. The ranks then agree whether any signal came from outside the job (``agree_on_cause``; the
agent's own SIGTERMs are no preemption, see ddpkit/process/stopping.py); if one did, rank 0 writes a snapshot and all
exit with 75 (EXIT_PREEMPTED), or 76 when no --snapshot-path leaves nothing to resume from. Models too large for that
hook keep DDP's C++ all-reduce, and the watch votes on the flags every VOTE_EVERY steps instead.

Drills are remembered in ``DIR/NAME.drills.json`` beside the snapshots: a drill fires once per snapshot
location, so the attempt that restarts after it (or the rerun after a preemption) does not fire it again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.base.log import get_logger
from ddpkit.process.stopping import mark_outside_signal, signal_from_outside
from ddpkit.train.config import Drill, TrainConfig
from ddpkit.train.output import say
from ddpkit.train.summary import DrillResult

__all__ = ["DrillBook", "DrillTrigger", "PreemptionWatch", "requeue_slurm_job"]

log = get_logger(__name__)


class PreemptionWatch:
    """Turns SIGTERM (and the configured preemption signal) into one step at which every rank stops."""

    #: Where the flags do not ride with the gradients: a vote on them every this many steps.
    VOTE_EVERY = 4

    def __init__(self, signals: tuple[signal.Signals, ...], device: torch.device, world_size: int = 1, *,
                 stop_dir: str | None = None) -> None:
        self.signals = tuple(dict.fromkeys(signals))
        self.stop_dir = stop_dir  # the agent's (WorkerContext.stop_dir): where it marks signals from outside
        self.world_size = world_size
        self.received: str | None = None
        self.piggyback = False  # True once the flags ride with the gradients (rides_gradients); else a vote
        self._one = torch.ones(1, device=device)
        self._zero = torch.zeros(1, device=device)
        self._votes = torch.zeros(1, device=device)
        self._votes_work: Any = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            # a raw write: the handler may interrupt a write to sys.stdout (re-entering it would raise). Whether
            # it is a preemption (from outside the job) or the agent stopping the group is decided after the step
            os.write(1, f"received {self.received}: finishing this step\n".encode())

    def install(self) -> PreemptionWatch:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def rides_gradients(self, riding: bool) -> None:
        """Whether the gradient averaging hook carries this watch's flag (``register_gradient_averaging`` returned
        a hook for it): then ``should_stop`` reads the flags summed with the last bucket, else it votes."""
        self.piggyback = riding

    # Rider (comm/gradients.py): the flag goes out with the last gradient bucket, the ranks' sum comes back.
    def outgoing(self) -> torch.Tensor:
        return self._one if self.received is not None else self._zero

    def arrived(self, total: torch.Tensor) -> None:
        self._votes.copy_(total)

    def should_stop(self, step: int) -> bool:
        """After step ``step`` (counted alike on every rank): did any rank raise its flag? The same answer on every
        rank. Without the hook, a vote starts (asynchronously) after every VOTE_EVERY-th step and is read one
        step later, so no rank waits for it in the meantime."""
        if self.world_size == 1:
            return self.received is not None
        if self.piggyback:
            return bool(self._votes.item() > 0)
        stop = False
        if self._votes_work is not None:
            self._votes_work.wait()
            self._votes_work = None
            stop = bool(self._votes.item() > 0)
        if not stop and step % self.VOTE_EVERY == 0:
            self._votes.copy_(self._one if self.received is not None else self._zero)
            self._votes_work = dist.all_reduce(self._votes, async_op=True)
        return stop

    def agree_on_cause(self) -> tuple[int, int]:
        """After every rank stopped: (ranks that got a signal from outside the job, ranks that got any stop
        signal), the same on every rank. One small all-reduce, only when stopping."""
        outside = signal_from_outside(self.received, self.stop_dir)
        counts = torch.tensor([float(outside), float(self.received is not None)], device=self._one.device)
        if self.world_size > 1:
            dist.all_reduce(counts)
        return int(counts[0].item()), int(counts[1].item())

    def drain(self) -> None:
        """Wait for a vote still in flight (at the end of training: no collective left unfinished)."""
        if self._votes_work is not None:
            self._votes_work.wait()
            self._votes_work = None


def requeue_slurm_job() -> str:
    """``scontrol requeue $SLURM_JOB_ID``; returns what happened, in words (never raises)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return "--requeue: not running under Slurm (SLURM_JOB_ID is unset): nothing requeued"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"--requeue: scontrol not found on PATH: Slurm job {job_id} not requeued"
    done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        return f"--requeue: scontrol requeue {job_id} failed ({done.returncode}): {done.stderr.strip()}"
    return f"Slurm job {job_id} requeued: the next allocation resumes from the snapshot"


class DrillBook:
    """Which drills already fired for this snapshot location, persisted so a restart does not repeat them."""

    def __init__(self, path: Path | None, drills: tuple[Drill, ...]) -> None:
        self.path = path
        self.drills = drills
        self.fired: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            self.fired = json.loads(path.read_text() or "{}")

    def due(self, epoch: int, batch: int, steps: int) -> Drill | None:
        """The drill that fires at this step (half-way through its epoch), if any has not fired yet."""
        for drill in self.drills:
            if str(drill) not in self.fired and drill.epoch == epoch and batch == steps // 2:
                return drill
        return None

    def record(self, drill: Drill, *, epoch: int, global_step: int, target_rank: int) -> None:
        """Remember (durably, atomically) that ``drill`` fires now; called by rank 0 before it fires."""
        self.fired[str(drill)] = {"kind": drill.kind, "epoch": epoch, "global_step": global_step,
                                  "rank": target_rank, "time": time.time()}
        self._persist()

    def resumed(self, step: int) -> None:
        """The run resumed at ``step`` (rank 0, after loading a snapshot): each drill that fired and was not yet
        followed by a resume was followed by this one (a later drill's resume is its own, not the first's)."""
        new = {name: {**rec, "resumed_step": step} for name, rec in self.fired.items()
               if rec and "resumed_step" not in rec}
        if new:
            self.fired.update(new)
            self._persist()

    def _persist(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(self.fired, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def report(self, resumed_step: int | None, interval_steps: int) -> list[DrillResult]:
        """For each fired drill: what was injected, and what was lost (steps re-done after the resume)."""
        out = []
        asked = {str(d) for d in self.drills}
        for name, rec in self.fired.items():
            if name not in asked or not rec:  # fired by another run, or not known on this rank
                continue
            # its own resume (``resumed``), else this attempt's (a book written before drills kept theirs)
            resumed_at = rec.get("resumed_step", resumed_step)
            if rec["kind"] == "preempt":  # the preemption snapshot is taken where training stops
                lost: int | None = 0
            else:
                lost = None if resumed_at is None else max(0, rec["global_step"] - resumed_at)
            out.append(DrillResult(drill=name, injected=f"{rec['kind']} of rank {rec['rank']} at epoch {rec['epoch']} "
                                   f"(global step {rec['global_step']})", fired_at_step=rec["global_step"],
                                   resumed_at_step=resumed_at,
                                   lost_steps=lost, within_interval=lost is not None and lost <= interval_steps))
        return out


class DrillTrigger:
    """Fires the drill due at a step (the trainer's one call per step): every rank reaches it at the same step, rank 0
    records it in the book, then its target rank injects the fault: SIGKILL, or the preemption signal."""

    def __init__(self, book: DrillBook, config: TrainConfig, *, rank: int, world_size: int, steps_per_epoch: int,
                 stop_dir: str | None) -> None:
        self.book, self.cfg = book, config
        self.rank, self.world, self.steps_per_epoch = rank, world_size, steps_per_epoch
        self.stop_dir = stop_dir  # the agent's (WorkerContext.stop_dir): where a preempt drill leaves its mark

    def fire_due(self, epoch: int, batch: int, step: int) -> None:
        drill = self.book.due(epoch, batch, self.steps_per_epoch)
        if drill is None:
            return
        target = (self.world - 1 if drill.rank is None else drill.rank) if drill.kind == "kill-worker" else 0
        if target >= self.world:
            if self.rank == 0:
                log.warning("drill %s: rank %d does not exist in a world of %d; skipped", drill, target, self.world)
            return
        if self.rank == 0:
            self.book.record(drill, epoch=epoch, global_step=step, target_rank=target)
        else:
            self.book.fired[str(drill)] = {}
        dist.barrier()  # the drill is on record before it fires: the restarted attempt will not repeat it
        if self.rank != target:
            return
        if drill.kind == "kill-worker":
            say(f"drill {drill}: killing rank {self.rank} (pid {os.getpid()}) with SIGKILL at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            say(f"drill {drill}: sending SIG{self.cfg.preempt_signal} to rank 0 at step {step}")
            # the drill plays the world outside the job: it leaves the mark the agent leaves for such a signal
            mark_outside_signal(self.stop_dir, f"SIG{self.cfg.preempt_signal}")
            os.kill(os.getpid(), self.cfg.preempt_signum)
