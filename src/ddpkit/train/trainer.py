"""The training loop: one readable DDP loop with snapshots, exact resume, preemption and drills.

    from ddpkit.train import Trainer, TrainConfig, TrainJob
    rt = ddpkit.init()
    job = TrainJob(model=net, dataset=data, optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                   loss_fn=torch.nn.functional.mse_loss)
    summary = Trainer(job, TrainConfig(epochs=5, snapshot_path="/shared/run/snap.pt"), rt).fit()

Start-up, in order: rank 0 finds the newest snapshot that verifies (reporting and skipping broken ones) and
checks it was made by the same job; it broadcasts that decision, so every rank resumes from the same step or
every rank exits with the same error. Rank 0 loads the model weights before DDP wraps the model (DDP's
constructor broadcasts them), then broadcasts the optimizer state and scatters each rank its own RNG state.
Training continues at the step after the snapshot: nothing saved is run again.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.log import get_logger
from ddpkit.train.config import TrainConfig, snapshot_location
from ddpkit.train.data import Batches
from ddpkit.train.faults import DrillBook, PreemptionWatch, requeue_slurm_job
from ddpkit.train.gradients import register_gradient_averaging
from ddpkit.train.output import say
from ddpkit.train.rng import capture_rng, restore_rng, seed_everything
from ddpkit.train.snapshot import AsyncWriter, CpuShadow, SnapshotDir, copy_to_cpu, read_snapshot, write_snapshot
from ddpkit.train.stops import (
    LastSnapshot,
    describe_lost_peer,
    host_table,
    mark_outside_signal,
    preemption_outcome,
    probe_answering,
)

if TYPE_CHECKING:
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


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Trainer:
    def __init__(self, job: TrainJob, config: TrainConfig, runtime: Runtime, *, transport: str | None = None) -> None:
        self.job = job
        self.cfg = config
        self.rt = runtime
        self.transport = transport  # a gradients.TRANSPORTS name (plan_transport), or None: the backend's own
        self.rank, self.world = runtime.rank, runtime.world_size
        self.batches = Batches(job.dataset, batch_size=config.batch_size, rank=self.rank, world_size=self.world,
                               seed=config.seed, device=runtime.device)
        self.steps_per_epoch = self.batches.steps()
        self.snapdir: SnapshotDir | None = None
        drill_file = None
        if config.snapshot_path is not None:
            directory, name, ext = snapshot_location(config.snapshot_path)
            self.snapdir = SnapshotDir(directory, name, ext, config.keep)
            drill_file = directory / f"{name}.drills.json"
        self.drills = DrillBook(drill_file if self.rank == 0 else None, config.drills)
        self.writer = AsyncWriter()
        self.shadow = CpuShadow()
        self.phase = "start-up (agreeing on the snapshot to resume from)"
        """What the ranks are doing now, for the message when a peer stops answering."""
        self.hosts: list[str] = []
        """Each rank's host, ``name (address)``, gathered once at start-up."""
        self.last_snapshot = LastSnapshot(configured=self.snapdir is not None)
        """The newest snapshot this rank knows to exist (rank 0: written; the others: taken together)."""
        self.epoch_losses: list[float] = []
        """This rank's losses of the resumed epoch's steps before its (mid-epoch) snapshot."""
        self.summary: dict[str, Any] = {
            "job": job.name, "model": config.model if config.job is None else config.job,
            "parameters": sum(p.numel() for p in job.model.parameters()), "world_size": self.world,
            "backend": runtime.backend, "device": str(runtime.device), "epochs": config.epochs,
            "batch_size": config.batch_size, "steps_per_epoch": self.steps_per_epoch,
            "restarts": runtime.world.restart_count or 0, "snapshots_written": 0, "snapshots_loaded": 0,
            "snapshot_paths": [], "snapshot_stall_s": [], "skipped_snapshots": [], "resumed_from": None,
            "loss_history": {}, "epoch_s": {}, "preempted": False}

    # ---- start-up: agree on the snapshot to resume from -------------------------------------------------
    def _decide(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Rank 0: the newest valid snapshot of this job (or an error), as a broadcastable decision."""
        decision: dict[str, Any] = {"error": None, "header": None, "fired": {}, "skipped": []}
        if self.snapdir is None:
            return decision, None
        self.snapdir.remove_stale_temps()
        decision["fired"] = self.drills.fired
        info, skipped = self.snapdir.newest_valid()
        decision["skipped"] = skipped
        if info is None:
            return decision, None
        header, state = read_snapshot(info.path)
        found, wanted = header.get("fingerprint", {}), self.cfg.fingerprint()
        diff = {k: (found.get(k), wanted.get(k)) for k in set(found) | set(wanted) if found.get(k) != wanted.get(k)}
        own = self.job.model.state_dict()
        shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
        if not diff and shapes != {k: tuple(v.shape) for k, v in own.items()}:
            diff = {"model parameters": ("different names or shapes", "those of this model")}
        if diff:
            listed = "; ".join(f"{k}: snapshot {a!r}, this run {b!r}" for k, a, b in
                               ((k, *v) for k, v in sorted(diff.items())))
            decision["error"] = (f"snapshot {info.path} was written by a different job ({listed})",
                                 "a snapshot of the same model and settings",
                                 "pass the same options as the run that wrote it, or a new --snapshot-path")
            return decision, None
        decision["header"] = dict(header, path=str(info.path))
        return decision, state

    def _resume(self) -> tuple[int, int, int]:
        """Agree on a snapshot, restore it everywhere; returns (epoch, batch, global step) to continue from."""
        decision, state = self._decide() if self.rank == 0 else ({}, None)
        box: list[Any] = [decision]
        dist.broadcast_object_list(box, src=0)
        decision = box[0]
        for message in decision["skipped"]:
            if self.rank == 0:
                say(message)
        self.summary["skipped_snapshots"] = decision["skipped"]
        self.drills.fired = dict(decision["fired"])
        if decision["error"]:
            raise ConfigError(*decision["error"])
        header = decision["header"]
        if header is None:
            seed_everything(self.cfg.seed + self.rank)
            return 0, 0, 0
        if self.rank == 0:
            assert state is not None
            self.job.model.load_state_dict(state["model"])
        box = [state["optimizer"] if state is not None else None]
        dist.broadcast_object_list(box, src=0)
        self.job.optimizer.load_state_dict(box[0])
        if header["world_size"] == self.world:
            # each rank's RNG states and the losses of the epoch's steps before the snapshot (a mid-epoch one)
            parts = None if state is None else list(zip(state["rng"], state.get("epoch_losses") or [[]] * self.world,
                                                        strict=True))
            mine: list[Any] = [None]
            dist.scatter_object_list(mine, parts, src=0)
            restore_rng(mine[0][0])
            self.epoch_losses = list(mine[0][1])
        else:
            if self.rank == 0:
                log.warning("snapshot from %d ranks, now %d: RNG states re-seeded (resume is not bitwise exact)%s",
                            header["world_size"], self.world, f"; epoch {header['next_epoch']}'s loss will count "
                            "only the steps after the snapshot" if header["next_batch"] else "")
            seed_everything(self.cfg.seed + self.rank + 7919 * header["global_step"])
        box = [state["loss_history"] if state is not None else {}]
        dist.broadcast_object_list(box, src=0)
        self.summary["loss_history"] = {int(k): v for k, v in box[0].items()}
        self.summary["snapshots_loaded"] = 1
        self.last_snapshot = LastSnapshot(configured=True, step=int(header["global_step"]), path=header["path"])
        self.summary["resumed_from"] = {"path": header["path"], "epoch": header["next_epoch"],
                                        "batch": header["next_batch"], "global_step": header["global_step"]}
        if self.rank == 0:
            at = f"Epoch {header['next_epoch']}" + (f", step {header['next_batch']}" if header["next_batch"] else "")
            say(f"Loading snapshot {header['path']}\nResuming training from snapshot at {at}")
        return int(header["next_epoch"]), int(header["next_batch"]), int(header["global_step"])

    # ---- snapshots -----------------------------------------------------------------------------------
    def _snapshot(self, ddp: DDP, *, epoch: int, next_epoch: int, next_batch: int, step: int, urgent: bool,
                  losses: Sequence[torch.Tensor] = ()) -> None:
        """All ranks: gather RNG states to rank 0; rank 0 writes (in the background when asked and not urgent)."""
        assert self.snapdir is not None
        self.phase = f"the snapshot of step {step} (gathering RNG states to rank 0)"
        t0 = time.perf_counter()
        # with the RNG states, each rank's losses of this epoch so far: a run resumed mid-epoch reports the epoch's
        # loss over all its steps, as an uninterrupted run does
        mine = (capture_rng(), torch.stack(list(losses)).tolist() if losses else [])
        parts: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        path = self.snapdir.path_for(step)
        if self.rank != 0:  # rank 0 writes it, synchronously or in the background
            self.last_snapshot = LastSnapshot(configured=True, step=step, path=f"{path}, written by rank 0")
            return
        # references to the live tensors (parameters and optimizer state change only in optimizer.step());
        # buffers (e.g. BatchNorm statistics) may change in the next forward, so they are cloned now (small)
        params = {p.data_ptr() for p in ddp.module.parameters()}
        model = {k: v if v.data_ptr() in params else v.detach().clone() for k, v in ddp.module.state_dict().items()}
        assert parts is not None
        state = {"model": model, "optimizer": self.job.optimizer.state_dict(), "rng": [p[0] for p in parts],
                 "epoch_losses": [p[1] for p in parts], "loss_history": dict(self.summary["loss_history"])}
        header = {"epoch": epoch, "next_epoch": next_epoch, "next_batch": next_batch, "global_step": step,
                  "sampler_epoch": next_epoch, "world_size": self.world, "fingerprint": self.cfg.fingerprint(),
                  "config": self.cfg.as_dict(), "writer_rank": self.rank, "writer_pid": os.getpid(),
                  "created": time.time(), "versions": {"torch": torch.__version__, "ddpkit": ddpkit.__version__,
                                                       "python": sys.version.split()[0]}}
        snapdir = self.snapdir

        def done() -> None:
            self.last_snapshot = LastSnapshot(configured=True, step=step, path=str(path))
            snapdir.prune()
            say(f"Epoch {epoch} | Training snapshot saved at {path}")

        if self.cfg.async_snapshot and not urgent:
            self.writer.join()  # the shadow buffers are free again
            shadow = self.shadow
            # the copy runs on the writer thread while this thread goes on with the next forward and backward;
            # fit() waits for it (wait_copied) right before the next optimizer.step()
            self.writer.submit(path, lambda: shadow.copy(state), header, after=done)
        else:
            self.writer.join()
            write_snapshot(path, copy_to_cpu(state) if self.rt.device.type != "cpu" else state, header)
            done()
        self.summary["snapshot_stall_s"].append(time.perf_counter() - t0)
        self.summary["snapshots_written"] += 1
        self.summary["snapshot_paths"].append(str(path))

    # ---- drills ---------------------------------------------------------------------------------------
    def _fire_drill(self, epoch: int, batch: int, step: int) -> None:
        drill = self.drills.due(epoch, batch, self.steps_per_epoch)
        if drill is None:
            return
        target = (self.world - 1 if drill.rank is None else drill.rank) if drill.kind == "kill-worker" else 0
        if target >= self.world:
            if self.rank == 0:
                log.warning("drill %s: rank %d does not exist in a world of %d; skipped", drill, target, self.world)
            return
        if self.rank == 0:
            self.drills.record(drill, epoch=epoch, global_step=step, target_rank=target)
        else:
            self.drills.fired[str(drill)] = {}
        dist.barrier()  # the drill is on record before it fires: the restarted attempt will not repeat it
        if self.rank != target:
            return
        if drill.kind == "kill-worker":
            say(f"drill {drill}: killing rank {self.rank} (pid {os.getpid()}) with SIGKILL at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            say(f"drill {drill}: sending SIG{self.cfg.preempt_signal} to rank 0 at step {step}")
            mark_outside_signal(f"SIG{self.cfg.preempt_signal}")  # the drill plays the world outside the job
            os.kill(os.getpid(), self.cfg.preempt_signum)

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``config.epochs`` (or until preempted); returns the summary (rank 0's is complete)."""
        cfg, device = self.cfg, self.rt.device
        # before _resume seeds the generators: importing rich draws from Python's global RNG (rich.style)
        progress = _Progress.maybe(self.rank == 0 and cfg.progress is not False and (cfg.progress or _on_terminal()))
        start_epoch, start_batch, step = self._resume()
        self.hosts = host_table(self.rt)
        model = self.job.model.to(device)
        # gradients live in DDP's all-reduce buckets (no copy into the bucket and back each step, one copy of the
        # gradients in memory instead of two); the arithmetic is the same, results are bitwise equal
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        watch = PreemptionWatch((signal.SIGTERM, cfg.preempt_signum), device, self.world).install()
        # How gradients are averaged (train/gradients.py): small models through ddpkit's hook, with the transport
        # that suits the backend, the ranks' stop flags riding on the last bucket; larger ones by DDP's own C++
        # all-reduce (None), the stop flags then voted on every few steps.
        averaging = register_gradient_averaging(ddp, world_size=self.world, rider=watch, transport=self.transport)
        watch.rides_gradients(averaging is not None)
        self.summary["grad_transport"] = averaging.transport if averaging is not None else "ddp all-reduce"
        self.summary["stop_flags"] = ("gradient all-reduce" if watch.piggyback
                                      else f"vote every {watch.VOTE_EVERY} steps")
        step_times: list[float] = []
        samples = 0
        t_start = time.perf_counter()
        self.summary["loop_at"] = time.time()
        if start_epoch >= cfg.epochs and self.rank == 0:
            say(f"Training already complete: the snapshot is at epoch {start_epoch} of {cfg.epochs}")
        try:
            for epoch in range(start_epoch, cfg.epochs):
                first = start_batch if epoch == start_epoch else 0
                progress.start(epoch, self.steps_per_epoch - first)
                losses: list[torch.Tensor] = []
                if epoch == start_epoch and first:  # resumed mid-epoch: the losses of the steps before the snapshot
                    losses = list(torch.tensor(self.epoch_losses, device=device).unbind())
                epoch_times: list[float] = []
                t_epoch = time.perf_counter()
                for batch, (x, y) in enumerate(self.batches.epoch(epoch, first), start=first):
                    t0 = time.perf_counter()
                    self.phase = f"the gradient all-reduce of step {step + 1} (epoch {epoch}, batch {batch})"
                    self.job.optimizer.zero_grad(set_to_none=True)
                    loss = self.job.loss_fn(ddp(x), y)
                    loss.backward()  # DDP all-reduces the gradients (and the ranks' stop flags) here
                    if self.writer.copying:  # an async snapshot still copies the parameters: not yet
                        self.summary["snapshot_stall_s"][-1] += self.writer.wait_copied()
                    self.job.optimizer.step()
                    step += 1
                    losses.append(loss.detach())
                    samples += len(x)
                    epoch_times.append(time.perf_counter() - t0)
                    progress.advance(loss)
                    if "first_step_at" not in self.summary:  # measures a restart: kill -> first resumed step
                        self.summary["first_step_at"] = time.time()
                    self._fire_drill(epoch, batch, step)
                    self.phase = f"the stop-flag vote after step {step} (epoch {epoch})"
                    if watch.should_stop(step):  # a preemption signal reached some rank: all stop after this step
                        return self._preempted(ddp, watch, epoch, batch + 1, step, t_start, samples,
                                               step_times + epoch_times, losses)
                elapsed = time.perf_counter() - t_epoch
                step_times += epoch_times
                self.summary["epoch_s"][epoch] = elapsed
                self.summary["loss_history"][epoch] = float(torch.stack(losses).mean()) if losses else math.nan
                self._epoch_line(epoch, len(epoch_times), elapsed, epoch_times)
                if self.snapdir is not None and ((epoch + 1) % cfg.save_every == 0 or epoch + 1 == cfg.epochs):
                    self._snapshot(ddp, epoch=epoch, next_epoch=epoch + 1, next_batch=0, step=step, urgent=False)
            watch.drain()
            self.writer.join()
        finally:
            progress.stop()
            watch.uninstall()
        self._finish(step, t_start, samples, step_times)
        return self.summary

    def _epoch_line(self, epoch: int, steps: int, elapsed: float, times: list[float]) -> None:
        line = f"[RANK {self.rank}] Epoch {epoch} | Batchsize: {self.cfg.batch_size} | Steps: {steps}"
        if self.rank == 0:
            rate = steps * self.cfg.batch_size * self.world / elapsed if elapsed > 0 else math.nan
            line += (f" | loss {self.summary['loss_history'][epoch]:.4f} | {rate:,.0f} samples/s | step p50 "
                     f"{_percentile(times, 50) * 1e3:.2f} ms p95 {_percentile(times, 95) * 1e3:.2f} ms")
        say(line)

    def _preempted(self, ddp: DDP, watch: PreemptionWatch, epoch: int, next_batch: int, step: int,
                   t_start: float, samples: int, times: list[float], losses: list[torch.Tensor]) -> dict[str, Any]:
        next_epoch, next_batch = (epoch + 1, 0) if next_batch >= self.steps_per_epoch else (epoch, next_batch)
        self.phase = f"the vote on why the ranks stop, after step {step}"
        outside, signalled = watch.agree_on_cause()
        if not outside:  # only the job's own agents sent signals: they are stopping the group after a failure
            self.summary.update(stopped_by_agent=True, signal=watch.received, global_step=step)
            who = f"rank {self.rank} got {watch.received}" if watch.received else \
                f"{signalled} other rank(s) got a stop signal"
            log.error("stopped after step %d: %s, and no agent received a signal from outside the job: an agent is "
                      "stopping its workers (after a failure, a lost rendezvous store or a membership change); not a "
                      "preemption, no snapshot taken; %s", step, who, self.last_snapshot)
            return self.summary
        self.writer.join()  # a background snapshot still being written counts once it is on disk
        if next_batch == 0 and losses:  # stopped after an epoch's last step: the epoch is complete, so is its loss
            self.summary["loss_history"][epoch] = float(torch.stack(losses).mean())
        if self.snapdir is not None:
            self._snapshot(ddp, epoch=epoch, next_epoch=next_epoch, next_batch=next_batch, step=step, urgent=True,
                           losses=losses if next_batch else ())
        code, line = preemption_outcome(self.last_snapshot, step)
        self.summary.update(preempted=True, signal=watch.received or "another rank's signal", exit_code=code)
        if self.rank == 0:
            say(f"Preempted at epoch {epoch}, step {step}: {line}")
            if self.cfg.requeue:
                message = requeue_slurm_job()
                say(message)
                self.summary["requeue"] = message
        self._finish(step, t_start, samples, times)
        return self.summary

    def lost_peer(self, exc: BaseException) -> str:
        """After a collective failed: find who stopped answering and say it, with the phase and the snapshot."""
        attempt = str(self.rt.world.restart_count or 0)
        answered = probe_answering(self.rank, self.world, attempt)
        error = str(exc).strip().splitlines()[0][-300:] if str(exc).strip() else type(exc).__name__
        return describe_lost_peer(rank=self.rank, hosts=self.hosts or [socket.gethostname()] * self.world,
                                  phase=self.phase, snapshot=self.last_snapshot, answered=answered, error=error)

    def _finish(self, step: int, t_start: float, samples: int, times: list[float]) -> None:
        wall = time.perf_counter() - t_start
        self.summary["loop_end_at"] = time.time()
        history = self.summary["loss_history"]
        resumed = self.summary["resumed_from"]
        interval = self.cfg.save_every * self.steps_per_epoch
        self.summary.update(
            global_step=step, wall_s=wall, samples_per_s=samples * self.world / wall if wall > 0 and samples else 0.0,
            step_ms_p50=_percentile(times, 50) * 1e3, step_ms_p95=_percentile(times, 95) * 1e3,
            first_loss=history[min(history)] if history else None,
            final_loss=history[max(history)] if history else None,
            drills=self.drills.report(resumed["global_step"] if resumed else None, interval) if self.rank == 0 else [])


def _on_terminal() -> bool:
    """Is stdout a person's terminal? Open MPI hands its ranks a pseudo-terminal even when mpirun's own output goes
    to a file or a pipe, so under Open MPI only an explicit --progress shows the bar."""
    return sys.stdout.isatty() and "OMPI_COMM_WORLD_RANK" not in os.environ


class _Progress:
    """A rich progress bar on rank 0 when attached to a terminal; otherwise nothing. Shown from the first epoch."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.task: Any = None
        if enabled:
            from rich.progress import Progress

            self.bar = Progress(transient=True)

    @classmethod
    def maybe(cls, enabled: bool) -> _Progress:
        return cls(enabled)

    def start(self, epoch: int, total: int) -> None:
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
            else:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(f"epoch {epoch}", total=total)

    def advance(self, loss: torch.Tensor) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"loss {float(loss.detach()):.4f}")

    def stop(self) -> None:
        if self.task is not None:  # started
            self.bar.stop()
