"""Faults the trainer survives: preemption signals, Slurm requeue, and drills that inject a fault once on purpose.

Preemption: the handler only sets a flag, and the flag travels with the gradients: a DDP communication hook
appends it to the last gradient bucket's all-reduce (one extra number; no extra collective, no extra round trip).
When backward returns, every rank holds the same sum of flags, so all ranks stop after the same step, even when
the signal reached a single rank, and none is left waiting in a collective. Rank 0 then writes a snapshot and all
exit with 75 (EXIT_PREEMPTED). Models above PIGGYBACK_MAX parameters keep DDP's C++ all-reduce instead (a copy of
a large last bucket to append one number would cost more) and vote on the flags every VOTE_EVERY steps.

The same hook makes small gradients cheaper to average on gloo: where the gathered bucket is at most
GATHER_MAX_BYTES, it is all-gathered and summed locally in rank order instead of all-reduced. Small CPU messages
are latency-bound, and gloo's all-gather takes half the message steps of its all-reduce (ring: n-1 instead of
2(n-1)); measured on 2 ranks here (benchmarks/results/bench_train.md): 23 floats 0.5-0.8 ms instead of 1.4-2.1 ms,
64 Ki floats 1.4-2.4x faster, 256 Ki about even (1.0-1.3x), hence the 512 KiB bound on the gathered size.
Every rank sums the same gathered rows in the same order, so the ranks stay bitwise identical (the same as the
all-reduce on 2 ranks, where a + b == b + a).

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
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.collectives import all_gather_single
from ddpkit.log import get_logger
from ddpkit.train.config import Drill

__all__ = ["DrillBook", "PreemptionWatch", "requeue_slurm_job"]

log = get_logger(__name__)


class PreemptionWatch:
    """Turns SIGTERM (and the configured preemption signal) into one step at which every rank stops."""

    #: Models up to this many parameters carry the flag in their (single, small) gradient bucket.
    PIGGYBACK_MAX = 1 << 18
    #: Larger models keep DDP's built-in C++ all-reduce and vote on the flags every this many steps.
    VOTE_EVERY = 4
    #: On gloo, a bucket whose gathered size (bytes x ranks) is at most this is all-gathered and summed locally.
    GATHER_MAX_BYTES = 512 << 10

    def __init__(self, signals: tuple[signal.Signals, ...], device: torch.device, world_size: int = 1) -> None:
        self.signals = tuple(dict.fromkeys(signals))
        self.world_size = world_size
        self.received: str | None = None
        self.piggyback = False
        self.gather = False
        self._all_gather = all_gather_single()
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

    def attach(self, ddp: Any) -> None:
        """Small models: the flag rides in the gradient reduction (a Python hook; no extra collective, and their
        steps are short, so a separate vote would cost more). Larger models keep DDP's C++ all-reduce (a Python
        hook and a copy per bucket cost more than a tiny vote every VOTE_EVERY steps)."""
        self.piggyback = sum(p.numel() for p in ddp.module.parameters()) <= self.PIGGYBACK_MAX
        self.gather = self.world_size > 1 and dist.get_backend() == "gloo"
        if self.piggyback and self.world_size > 1:
            # a lambda: DDP rejects string annotations
            ddp.register_comm_hook(None, lambda state, bucket: self.hook(state, bucket))

    def hook(self, _: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP communication hook: average the gradients, and sum the ranks' stop flags with the last bucket."""
        grads = bucket.buffer()
        world = self.world_size
        if not bucket.is_last():
            return self._sum(grads, lambda total: total.div_(world))
        flag = self._one if self.received is not None else self._zero

        def unpack(total: torch.Tensor) -> torch.Tensor:
            self._votes.copy_(total[-1:])
            return total[:-1].div_(world)

        return self._sum(torch.cat([grads, flag.to(grads.dtype)]), unpack)

    def _sum(self, tensor: torch.Tensor, then: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.futures.Future[torch.Tensor]:
        """The sum of ``tensor`` over the ranks, passed to ``then`` (on the thread that completes the operation)."""
        world = self.world_size
        if self.gather and tensor.numel() * tensor.element_size() * world <= self.GATHER_MAX_BYTES:
            rows = tensor.new_empty(world * tensor.numel())
            work = self._all_gather(rows, tensor, async_op=True)
            assert work is not None
            # fut.value() first: it raises when the all-gather failed (a lost peer, a timeout); summing ``rows``
            # anyway would read uninitialised memory, a garbage stop vote taken for a preemption (issue 19)
            return work.get_future().then(lambda fut: (fut.value(), then(rows.view(world, -1).sum(0)))[1])
        work = dist.all_reduce(tensor, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: then(fut.value()[0]))

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
        from ddpkit.train.stops import signal_from_outside

        outside = signal_from_outside(self.received)
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
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(self.fired, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def report(self, resumed_step: int | None, interval_steps: int) -> list[dict[str, Any]]:
        """For each fired drill: what was injected, and what was lost (steps re-done after the resume)."""
        out = []
        asked = {str(d) for d in self.drills}
        for name, rec in self.fired.items():
            if name not in asked or not rec:  # fired by another run, or not known on this rank
                continue
            if rec["kind"] == "preempt":  # the preemption snapshot is taken where training stops
                lost: int | None = 0
            else:
                lost = None if resumed_step is None else max(0, rec["global_step"] - resumed_step)
            out.append({"drill": name, "injected": f"{rec['kind']} of rank {rec['rank']} at epoch {rec['epoch']} "
                        f"(global step {rec['global_step']})", "fired_at_step": rec["global_step"],
                        "lost_steps": lost, "within_interval": lost is not None and lost <= interval_steps})
        return out
