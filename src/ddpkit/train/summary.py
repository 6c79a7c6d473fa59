"""What a training run reports: ``RunSummary``, typed, with how it ended (``RunOutcome``) and its ``--json`` form.

torch-free, so ``ddpkit train``'s CLI reads it without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ddpkit.process.stopping import RunOutcome
from ddpkit.train.timeline import phases

__all__ = ["DrillResult", "ResumedFrom", "RunSummary", "percentile"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass(frozen=True, kw_only=True)
class ResumedFrom:
    """The snapshot a run resumed from."""

    path: str
    epoch: int
    """The epoch training continued in."""
    batch: int
    """The batch of that epoch it continued at (0: the epoch's start)."""
    global_step: int
    """The snapshot's global step: training continued at the next."""


@dataclass(frozen=True, kw_only=True)
class DrillResult:
    """A drill that fired in this run: what was injected, and what it cost."""

    drill: str
    """As given: ``kill-worker@epoch=2,rank=1``."""
    injected: str
    """What was done, in words."""
    fired_at_step: int
    resumed_at_step: int | None
    """The step the run resumed at after this drill (None: it did not resume)."""
    lost_steps: int | None
    """Steps done again after the resume (None: the run did not resume)."""
    within_interval: bool
    """The loss is within one snapshot interval."""


@dataclass(kw_only=True)
class RunSummary:
    """One rank's account of a run (rank 0's is complete: losses, throughput, snapshots, restarts, drills)."""

    job: str
    model: str
    parameters: int
    world_size: int
    backend: str
    device: str
    epochs: int
    batch_size: int
    steps_per_epoch: int
    restarts: int
    """Times the run's ranks were started again: torch elastic's restarts, or under --heal its attempts before
    this one (``DDPKIT_ATTEMPT`` - 1)."""
    outcome: RunOutcome = RunOutcome.COMPLETED
    signal: str | None = None
    """The stop signal this rank received (or ``another rank's signal``); None when none stopped it."""
    snapshots_written: int = 0
    snapshots_loaded: int = 0
    snapshot_paths: list[str] = field(default_factory=list)
    snapshot_stall_s: list[float] = field(default_factory=list)
    """Seconds the training thread was held by each snapshot it wrote (an async one: its in-memory copy)."""
    skipped_snapshots: list[str] = field(default_factory=list)
    """One message per newer snapshot that did not verify at start-up."""
    resumed_from: ResumedFrom | None = None
    loss_history: dict[int, float] = field(default_factory=dict)
    """Each completed epoch's mean loss (this rank's), epochs done before a resume included."""
    epoch_s: dict[int, float] = field(default_factory=dict)
    grad_transport: str = ""
    stop_flags: str = ""
    """How the ranks' stop flags travel: with the gradient all-reduce, or a vote every few steps."""
    global_step: int = 0
    wall_s: float = 0.0
    samples_per_s: float = 0.0
    step_ms_p50: float = math.nan
    step_ms_p95: float = math.nan
    first_loss: float | None = None
    final_loss: float | None = None
    drills: list[DrillResult] = field(default_factory=list)
    requeue: str | None = None
    """What --requeue did, in words."""
    marks: dict[str, float] = field(default_factory=dict)
    """Epoch seconds of the timeline's marks (train/timeline.py) this process passed."""
    live_heals: int | None = None
    """Under --heal live: the times this rank re-formed its group with a replacement (None: not live-healed)."""
    replica_digests: list[str] | None = None
    """Under --heal live: every rank's SHA-256 of its final parameters, by rank (equal replicas, equal digests)."""

    @property
    def preempted(self) -> bool:
        return self.outcome.preempted

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code

    @property
    def steps_ran(self) -> bool:
        """Whether this attempt ran any step (p50 of its step times is a number)."""
        return not math.isnan(self.step_ms_p50)

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` document: every field, the timeline's phases, and the exit code after a preemption."""
        out: dict[str, Any] = {
            "job": self.job, "model": self.model, "parameters": self.parameters, "world_size": self.world_size,
            "backend": self.backend, "device": self.device, "epochs": self.epochs, "batch_size": self.batch_size,
            "steps_per_epoch": self.steps_per_epoch, "restarts": self.restarts,
            "snapshots_written": self.snapshots_written, "snapshots_loaded": self.snapshots_loaded,
            "snapshot_paths": self.snapshot_paths, "snapshot_stall_s": self.snapshot_stall_s,
            "skipped_snapshots": self.skipped_snapshots,
            "resumed_from": None if self.resumed_from is None else vars(self.resumed_from).copy(),
            "loss_history": self.loss_history, "epoch_s": self.epoch_s, "preempted": self.preempted,
            "outcome": self.outcome.value, "grad_transport": self.grad_transport, "stop_flags": self.stop_flags,
            "global_step": self.global_step, "wall_s": self.wall_s, "samples_per_s": self.samples_per_s,
            "step_ms_p50": self.step_ms_p50, "step_ms_p95": self.step_ms_p95, "first_loss": self.first_loss,
            "final_loss": self.final_loss, "drills": [vars(d).copy() for d in self.drills]}
        if self.outcome is not RunOutcome.COMPLETED:
            out.update(signal=self.signal, exit_code=self.exit_code)
        if self.requeue is not None:
            out["requeue"] = self.requeue
        if self.live_heals is not None:
            out.update(live_heals=self.live_heals, replica_digests=self.replica_digests)
        out.update(phases(self.marks))
        return out
