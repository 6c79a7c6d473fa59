"""``ddpkit run``'s goodput lines, from the watch: a user's script marks no step, but the watch counts its DDP steps
(``Recorder.step``: a DDP forward begins the next step) and, with ``--run-dir`` or under a heal supervisor, its
thread writes them to the run's goodput ledger as ``train`` does (``goodput.records``: rank 0 in ``goodput.jsonl``,
every other rank in ``goodput.rank-R.jsonl``). So ``ddpkit report RUN_DIR`` splits a script's time too: start-up
up to its first step, its steps, the pauses between them, and its end or failure.

A step runs from one DDP forward's start to the next one's (the recorder stamps each start, one clock read), so the
lines cover the script's loop without gaps and ``busy_s`` is the whole span: whatever a script does between two
forwards (loading data, a checkpoint, an evaluation) is inside a step here, as ddpkit cannot tell it apart. The
step in flight when the script ends has no end and is not counted (its time is the attempt's end). ``p50_ms`` is
the window's mean step (the watch times no single step on this path); ``sync_s`` is DDP's own gradient-sync
statistic, as the watch samples it (``Recorder._sample``), scaled to the window's steps, so the straggler wait
(``goodput.straggler``) is seen under DDP's C++ all-reduce too; None where no sample fell in the window.

Rank 0 also writes each epoch the script's sampler began (``EpochBegan``, from ``DistributedSampler.set_epoch``):
its steps are numbered from 1 in every attempt (``RankStarted.numbering``), so that is how the report learns where a
script that resumed from its own checkpoint went on from (``goodput.positions``); without it, its steps done again
are reported as not known.

A line at most every ``every_s`` (1 s), each one appended whole and fsynced: a job killed at any moment keeps what
was written. Rank 0 writes ``RankStarted`` (the time the group began) with its first step, and ``Finished`` when the
script returned 0; a script whose steps the watch does not see (no DDP model) writes nothing: its attempt is
``unmeasured``, not one long start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.base.log import get_logger
from ddpkit.goodput.records import EpochBegan, Finished, GoodputLog, RankStarted, Steps, attempt_from_environ
from ddpkit.process.worker_context import WorkerContext, process_started_at
from ddpkit.watch.processes import LAST_WORDS

if TYPE_CHECKING:
    from ddpkit.watch.recorder import Recorder

__all__ = ["StepLines"]

log = get_logger(__name__)


class StepLines:
    """One rank's goodput lines from its recorder; ``beat()`` on the watch's thread, ``end()`` once."""

    def __init__(self, run_dir: Path, recorder: Recorder, *, every_s: float = 1.0) -> None:
        context = WorkerContext.from_environ()
        self.rec = recorder
        self.every_s = every_s
        self._lock = threading.Lock()  # the watch's thread beats; the script's end ends
        self.log = GoodputLog(run_dir, attempt=attempt_from_environ(context.restart_count), rank=recorder.rank)
        self.first = 0  # the first step not yet written (0: none seen)
        self.at = 0.0  # when it began
        self.sync = (0.0, 0)  # the recorder's sampled sync total and count at ``at``
        # rank 0's start (the group exists now), written with the first step: a script whose steps the watch never
        # sees (no DDP model) leaves no line, and its attempt stays "unmeasured", not one long start-up
        self.started = RankStarted(attempt=self.log.attempt, time=time.time(), pid=os.getpid(), host=recorder.host,
                                   process=context.started_at if context.restart_count == 0 else process_started_at(),
                                   world_size=recorder.world_size, numbering="attempt")
        self.epochs = 0  # the recorder's epochs written
        LAST_WORDS.append(self._last)  # the watch ending this rank (exit 3, a lost store) writes them first

    def beat(self, *, final: bool = False) -> None:
        """Write the steps that ended since the last line (at most one line every ``every_s``, unless ``final``).
        A file that cannot be written ends the lines, with one warning: never the watch."""
        with self._lock:
            if self.log.closed:
                return
            try:
                self._beat(final)
            except OSError as exc:
                log.warning("watch: goodput lines stopped: %s: %s", self.log.path, exc)
                self.log.close()

    def _beat(self, final: bool) -> None:
        rec = self.rec
        n, began = rec.steps, rec.step_at  # step n is in flight since ``began``; 1..n-1 have ended
        if n < 1 or not rec.first_step_at:  # the main thread counted step 1 and has not stamped it yet
            return
        if self.first == 0:
            self.first, self.at, self.sync = 1, rec.first_step_at, (rec.sync_total, rec.sync_samples)
            if rec.rank == 0:
                self.log.write(dataclasses.replace(self.started, loaded_state=rec.loaded_state))
        if rec.rank == 0:
            self._write_epochs()
        if n <= self.first or (not final and began - self.at < self.every_s):
            return
        count = n - self.first
        span = max(0.0, began - self.at)
        total, samples = rec.sync_total, rec.sync_samples
        sync = None
        if samples > self.sync[1]:
            sync = (total - self.sync[0]) / (samples - self.sync[1]) * count
        self.log.write(Steps(attempt=self.log.attempt, start=self.at, end=began, first=self.first, last=n - 1,
                             busy_s=span, p50_ms=span / count * 1e3, rank=rec.rank, sync_s=sync))
        self.first, self.at, self.sync = n, began, (total, samples)

    def _last(self) -> None:
        self.beat(final=True)

    def _write_epochs(self) -> None:
        marks = self.rec.epochs[self.epochs:]
        for epoch, step, at in marks:
            self.log.write(EpochBegan(attempt=self.log.attempt, epoch=epoch, step=step, time=at))
        self.epochs += len(marks)

    def end(self, code: int) -> None:
        """The script returned ``code``: the last whole steps written; rank 0 says ``Finished`` when it succeeded
        (a failed attempt's end is the supervisor's or the accounting's: its tail is the failure)."""
        self.beat(final=True)
        with self._lock:
            if code == 0 and self.rec.rank == 0 and self.first and not self.log.closed:
                with contextlib.suppress(OSError):
                    self.log.write(Finished(attempt=self.log.attempt, time=time.time(),
                                            step=max(0, self.first - 1), outcome="completed"))
            self.log.close()
        with contextlib.suppress(ValueError):
            LAST_WORDS.remove(self._last)
