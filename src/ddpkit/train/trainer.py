"""The training loop: one readable DDP loop with snapshots, exact resume, preemption and drills.

    from ddpkit.train import Trainer, TrainConfig, TrainJob
    rt = ddpkit.init()
    job = TrainJob(model=net, dataset=data, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                   loss_fn=torch.nn.functional.mse_loss)
    summary = Trainer(job, TrainConfig(epochs=5, snapshot_path="/shared/run/snap.pt"), rt).fit()

``fit()``: agree on the snapshot to resume from (``Snapshotter.load``: train/snapshotter.py), wrap the model in DDP,
then per step: forward, backward (DDP averages the gradients, the ranks' stop flags riding along), wait for an
async snapshot's copy, optimizer step, drills, the stop vote; per epoch: the loss line and a snapshot. Training
continues at the step after the snapshot: nothing saved is run again. How a run ends is a ``RunOutcome``
(ddpkit/process/stopping.py: the state machine), reported in a ``RunSummary`` (train/summary.py).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from ddpkit.base.fault_injection import fault
from ddpkit.base.log import get_logger
from ddpkit.comm.gradients import GradientAveraging, register_gradient_averaging
from ddpkit.goodput.records import attempt_from_environ
from ddpkit.process.stopping import RunOutcome
from ddpkit.process.worker_context import WorkerContext
from ddpkit.train import live as healing
from ddpkit.train.config import TrainConfig
from ddpkit.train.data import Batches
from ddpkit.train.faults import DrillBook, DrillTrigger, PreemptionWatch, requeue_slurm_job
from ddpkit.train.output import say
from ddpkit.train.progress import Progress, on_terminal
from ddpkit.train.snapshotter import Snapshotter, StartPoint
from ddpkit.train.stops import host_table, preemption_outcome
from ddpkit.train.summary import RunSummary, percentile

if TYPE_CHECKING:
    from ddpkit.goodput.records import GoodputLog
    from ddpkit.live.rank.group import LiveGroup
    from ddpkit.runtime import Runtime

__all__ = ["TrainJob", "Trainer"]

log = get_logger(__name__)


@dataclass(kw_only=True)
class TrainJob:
    """What to train. Dataset items are ``(input, target)``; a TensorDataset takes the fast batched path."""

    model: nn.Module
    """The model, on CPU; the trainer moves it to the rank's device and wraps it in DDP."""
    dataset: Dataset[Any]
    """The same data on every rank; each rank trains on its DistributedSampler share."""
    optimizer: torch.optim.Optimizer
    """Built on ``model.parameters()``."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """loss_fn(output, target) -> scalar."""
    name: str = "custom"
    """Shown in the output and stored in snapshots."""


class Trainer:
    def __init__(self, job: TrainJob, config: TrainConfig, runtime: Runtime, *, transport: str | None = None,
                 context: WorkerContext | None = None, goodput: GoodputLog | None = None,
                 live: LiveGroup | None = None) -> None:
        self.job, self.cfg, self.rt = job, config, runtime
        self.goodput = goodput
        """This rank's goodput writer (ddpkit/goodput), or None: its steps (rank 0's: loads, saves, the end too)."""
        self.transport = transport  # a gradients.TRANSPORTS name (plan_transport), or None: the backend's own
        self.context = context or WorkerContext.from_environ()
        self.rank, self.world = runtime.rank, runtime.world_size
        self.batches = Batches(job.dataset, batch_size=config.batch_size, rank=self.rank, world_size=self.world,
                               seed=config.seed, device=runtime.device)
        self.steps_per_epoch = self.batches.steps()
        self.snapshots = Snapshotter(config, rank=self.rank, world_size=self.world, device=runtime.device)
        self.drills = DrillBook(self.snapshots.drill_file if self.rank == 0 else None, config.drills)
        self.drill_trigger = DrillTrigger(self.drills, config, rank=self.rank, world_size=self.world,
                                          steps_per_epoch=self.steps_per_epoch, stop_dir=self.context.stop_dir)
        self.phase = "start-up (agreeing on the snapshot to resume from)"
        """What the ranks are doing now, for the message when a peer stops answering."""
        self.hosts: list[str] = []
        """Each rank's host, ``name (address)``, gathered once at start-up."""
        self.averaging: GradientAveraging | None = None
        """ddpkit's gradient hook where it runs and a goodput writer wants the sync time; else None."""
        self.sync_s: float | None = None
        """The last step's time in the gradient sync (goodput.straggler), or None: not measured."""
        self.step_times, self.samples = list[float](), 0
        self.live = live
        """This rank's place in a live-healed job (--heal live: train/live.py), or None."""
        self.done_step, self.epoch_losses = 0, list[torch.Tensor]()
        self.pending_loss: torch.Tensor | None = None
        """The steps this rank applied, its losses of the epoch, the loss of its step in flight (for live heals)."""
        self.summary = RunSummary(
            job=job.name, model=config.model if config.job is None else config.job,
            parameters=sum(p.numel() for p in job.model.parameters()), world_size=self.world,
            backend=runtime.backend, device=str(runtime.device), epochs=config.epochs, batch_size=config.batch_size,
            steps_per_epoch=self.steps_per_epoch,
            restarts=attempt_from_environ(runtime.world.restart_count or 0) - 1)

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> RunSummary:
        """Train to ``config.epochs`` (or until stopped); returns the summary (rank 0's is complete)."""
        cfg, summary, live = self.cfg, self.summary, self.live
        # before load() seeds the generators: importing rich draws from Python's global RNG (rich.style)
        progress = Progress(self.rank == 0 and cfg.progress is not False and (cfg.progress or on_terminal()))
        start = healing.join(live, self) if live is not None and live.joining else self._load()
        ddp, preemption = self._wrap()
        summary.marks["loop"] = time.time()
        t_start = time.perf_counter()
        if start.epoch >= cfg.epochs and self.rank == 0:
            say(f"Training already complete: the snapshot is at epoch {start.epoch} of {cfg.epochs}")
        try:
            while True:
                try:
                    ended = self._epochs(ddp, preemption, start, progress, t_start)
                    break
                except Exception as exc:  # under --heal live, a lost peer: the survivors go on (train/live.py)
                    plan = None if live is None else live.lost_peer(exc)
                    if live is None or plan is None:
                        raise
                    preemption.uninstall()
                    start = healing.rejoin(live, self, plan, exc, ddp)
                    ddp, preemption = self._wrap()
            if isinstance(ended, RunSummary):
                return ended
            preemption.drain()
            self.snapshots.close()
        finally:
            progress.stop()
            preemption.uninstall()
            if self.goodput is not None:  # every way out (a lost peer's exception included) keeps the steps done
                self.goodput.flush()
        return self._finish(ended, t_start)

    def _load(self) -> StartPoint:
        """Where this run starts: the snapshot every rank agreed on (or none), and every rank's host."""
        loading, summary = time.time(), self.summary
        start = self.snapshots.load(self.job.model, self.job.optimizer, self.drills.fired)
        if self.goodput is not None:
            self.goodput.loaded(loading, time.time(), start.step if start.resumed_from is not None else None)
        self.drills.fired = dict(start.drills_fired)
        if start.resumed_from is not None and self.rank == 0:
            self.drills.resumed(start.step)
        summary.skipped_snapshots, summary.loss_history = start.skipped, start.loss_history
        if start.resumed_from is not None:
            summary.snapshots_loaded, summary.resumed_from = 1, start.resumed_from
        self.hosts = host_table(self.rt)
        return start

    def _epochs(self, ddp: DDP, preemption: PreemptionWatch, start: StartPoint, progress: Progress,
                t_start: float) -> int | RunSummary:
        """The epochs from ``start``: the last step done, or the summary of a run stopped by a signal."""
        cfg, goodput, step = self.cfg, self.goodput, start.step
        if start.missed_snapshot:  # a live heal at an epoch's end, before its snapshot (train/live.py)
            self._save(ddp, epoch=start.epoch - 1, next_epoch=start.epoch, next_batch=0, step=step, urgent=False)
        for epoch in range(start.epoch, cfg.epochs):
            first = start.batch if epoch == start.epoch else 0
            progress.start(epoch, self.steps_per_epoch - first)
            # resumed mid-epoch: the losses of the steps before the snapshot count towards the epoch's loss
            losses = self.epoch_losses = \
                list(torch.tensor(start.epoch_losses, device=self.rt.device).unbind()) if first else []
            times: list[float] = []
            t_epoch = time.perf_counter()
            for batch, (x, y) in enumerate(self.batches.epoch(epoch, first), start=first):
                t0 = time.perf_counter()
                w0 = time.time() if goodput is not None else 0.0
                self.phase = f"the gradient all-reduce of step {step + 1} (epoch {epoch}, batch {batch})"
                hung = fault("hang", phase="step", rank=self.rank, step=step + 1,
                             gen=None if self.live is None else self.live.gen)
                if hung is not None:  # test hook: this rank sleeps in its step, running, making no progress
                    log.warning("test fault: rank %d sleeps before step %d (at %.3f)", self.rank, step + 1, time.time())
                    time.sleep(float(hung.get("s", 3600)))
                loss = self._train_step(ddp, x, y)
                step = self.done_step = step + 1
                losses.append(loss)  # on the device: read back once per epoch (or by the progress bar)
                self.samples += len(x)
                times.append(time.perf_counter() - t0)
                if goodput is not None:  # gathered in memory; one fsynced line per second
                    goodput.step(w0, time.time(), step, self.sync_s)
                progress.advance(loss)
                self.summary.marks.setdefault("first_step", time.time())  # a restart: kill -> first resumed step
                if self.live is not None:  # one step after a heal the replicas compared; a replacement's first step
                    self.live.applied(step, self.job.model, self.job.optimizer)
                self.drill_trigger.fire_due(epoch, batch, step)
                self.phase = f"the stop-flag vote after step {step} (epoch {epoch})"
                if preemption.should_stop(step):  # a stop signal reached some rank: all stop after this step
                    self.step_times += times
                    return self._stop(ddp, preemption, epoch, batch + 1, step, t_start, losses)
            self.step_times += times
            self._end_epoch(ddp, epoch, step, time.perf_counter() - t_epoch, times, losses)
        return step

    def _wrap(self) -> tuple[DDP, PreemptionWatch]:
        """The model in DDP, its gradient averaging, and the preemption watch that turns stop signals into one common
        step."""
        device = self.rt.device
        model = self.job.model.to(device)
        # gradients live in DDP's all-reduce buckets (no copy into the bucket and back each step, one copy of the
        # gradients in memory instead of two); the arithmetic is the same, results are bitwise equal
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        preemption = PreemptionWatch((signal.SIGTERM, self.cfg.preempt_signum), device, self.world,
                                stop_dir=self.context.stop_dir).install()
        # How gradients are averaged (comm/gradients.py): small models through ddpkit's hook (the stop flags riding on
        # the last bucket; the sync timed for goodput.straggler); larger ones by DDP's C++ all-reduce (None), untimed.
        averaging = register_gradient_averaging(ddp, world_size=self.world, rider=preemption, transport=self.transport)
        preemption.rides_gradients(averaging is not None)
        self.averaging = averaging if averaging is not None and self.world > 1 and self.goodput is not None else None
        self.summary.grad_transport = averaging.transport if averaging is not None else "ddp all-reduce"
        self.summary.stop_flags = ("gradient all-reduce" if preemption.piggyback
                                   else f"vote every {preemption.VOTE_EVERY} steps")
        return ddp, preemption

    def _train_step(self, ddp: DDP, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step; returns the loss, detached and not read back (a device synchronisation on GPU)."""
        self.job.optimizer.zero_grad(set_to_none=True)
        loss = self.pending_loss = self.job.loss_fn(ddp(x), y)  # kept: a step in flight when a peer is lost
        loss.backward()  # DDP all-reduces the gradients (and the ranks' stop flags) here
        if self.averaging is not None:  # from this rank's last bucket handed over to the all-reduce's end
            self.sync_s = time.perf_counter() - self.averaging.last_bucket_at
        self.snapshots.wait_for_staging()  # an async snapshot still copies the parameters: not yet
        self.job.optimizer.step()
        return loss.detach()

    def _end_epoch(self, ddp: DDP, epoch: int, step: int, elapsed: float, times: list[float],
                   losses: list[torch.Tensor]) -> None:
        """The epoch's loss (read back here, once) and line; a snapshot when one is due."""
        self.summary.epoch_s[epoch] = elapsed
        self.summary.loss_history[epoch] = float(torch.stack(losses).mean()) if losses else math.nan
        line = f"[RANK {self.rank}] Epoch {epoch} | Batchsize: {self.cfg.batch_size} | Steps: {len(times)}"
        if self.rank == 0:
            rate = len(times) * self.cfg.batch_size * self.world / elapsed if elapsed > 0 else math.nan
            line += (f" | loss {self.summary.loss_history[epoch]:.4f} | {rate:,.0f} samples/s | step p50 "
                     f"{percentile(times, 50) * 1e3:.2f} ms p95 {percentile(times, 95) * 1e3:.2f} ms")
        say(line)
        if self.snapshots.enabled and self.cfg.snapshot_due(epoch + 1):
            self._save(ddp, epoch=epoch, next_epoch=epoch + 1, next_batch=0, step=step, urgent=False)

    def _save(self, ddp: DDP, *, epoch: int, next_epoch: int, next_batch: int, step: int, urgent: bool,
              losses: list[torch.Tensor] | None = None) -> None:
        self.phase = f"the snapshot of step {step} (gathering RNG states to rank 0)"
        if fault("kill", phase="snapshot", rank=self.rank, step=step,
                 gen=None if self.live is None else self.live.gen) is not None:  # test hook: lost in the gather
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.time()
        self.snapshots.save(ddp.module, self.job.optimizer, epoch=epoch, next_epoch=next_epoch, next_batch=next_batch,
                            step=step, urgent=urgent, loss_history=self.summary.loss_history, losses=losses or ())
        if self.goodput is not None:
            self.goodput.saved(began, time.time(), step)

    # ---- how the run ends (ddpkit/process/stopping.py) -------------------------------------------------------
    def _stop(self, ddp: DDP, preemption: PreemptionWatch, epoch: int, next_batch: int, step: int, t_start: float,
              losses: list[torch.Tensor]) -> RunSummary:
        """Every rank stopped after ``step``: stopped by the job's own agent, or preempted (saved or not)."""
        summary = self.summary
        next_epoch, next_batch = (epoch + 1, 0) if next_batch >= self.steps_per_epoch else (epoch, next_batch)
        self.phase = f"the vote on why the ranks stop, after step {step}"
        outside, signalled = preemption.agree_on_cause()
        if not outside:  # only the job's own agents sent signals: they are stopping the group after a failure
            summary.outcome, summary.signal = RunOutcome.STOPPED_BY_AGENT, preemption.received
            summary.global_step = step
            who = f"rank {self.rank} got {preemption.received}" if preemption.received else \
                f"{signalled} other rank(s) got a stop signal"
            log.error("stopped after step %d: %s, and no agent received a signal from outside the job: an agent is "
                      "stopping its workers (after a failure, a lost rendezvous store or a membership change); not a "
                      "preemption, no snapshot taken; %s", step, who, self.snapshots.last)
            return summary
        self.snapshots.close()  # a background snapshot still being written counts once it is on disk
        if next_batch == 0 and losses:  # stopped after an epoch's last step: the epoch is complete, so is its loss
            summary.loss_history[epoch] = float(torch.stack(losses).mean())
        if self.snapshots.enabled:
            self._save(ddp, epoch=epoch, next_epoch=next_epoch, next_batch=next_batch, step=step, urgent=True,
                       losses=losses if next_batch else None)
        summary.outcome, line = preemption_outcome(self.snapshots.last, step)
        summary.signal = preemption.received or "another rank's signal"
        if self.rank == 0:
            say(f"Preempted at epoch {epoch}, step {step}: {line}")
            if self.cfg.requeue:
                summary.requeue = requeue_slurm_job()
                say(summary.requeue)
        return self._finish(step, t_start)

    def _finish(self, step: int, t_start: float) -> RunSummary:
        s, times = self.summary, self.step_times
        s.wall_s = wall = time.perf_counter() - t_start
        s.marks["loop_end"] = time.time()
        s.global_step = step
        s.samples_per_s = self.samples * self.world / wall if wall > 0 and self.samples else 0.0
        s.step_ms_p50, s.step_ms_p95 = percentile(times, 50) * 1e3, percentile(times, 95) * 1e3
        s.first_loss = s.loss_history[min(s.loss_history)] if s.loss_history else None
        s.final_loss = s.loss_history[max(s.loss_history)] if s.loss_history else None
        s.snapshots_written, s.snapshot_paths, s.snapshot_stall_s = (len(self.snapshots.paths), self.snapshots.paths,
                                                                     self.snapshots.stalls)
        resumed = s.resumed_from.global_step if s.resumed_from else None
        s.drills = self.drills.report(resumed, self.cfg.save_every * self.steps_per_epoch) if self.rank == 0 else []
        if self.live is not None:
            s.replica_digests = self.live.verify(self.job.model, self.job.optimizer, step=step, where="at the end")
            s.live_heals = self.live.heals
        if self.goodput is not None:
            self.goodput.finished(s.marks["loop_end"], step, s.outcome.value)
        return s
