"""One rank's progress, as the watch publishes it: its watched calls (``calls.py``: every collective entered and
completed, every point-to-point call posted), the current step, the marked phase, and step / gradient-sync timings
for the straggler check.

The per-step path (``step``) runs on the rank's training thread inside every step, where Python runs 5-7 times slower
than in a tight loop (benchmarks/results/bench_watch.md): it takes no lock, counts every step and times one in
SAMPLE_EVERY. The cold paths (phases, the exit summary) keep a lock. Nothing here talks to the store (``monitor.py``
does).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any

from ddpkit.watch.calls import CALLERS, Calls, P2PBook, future_error
from ddpkit.watch.records import Heartbeat, Timings

__all__ = ["Live", "Recorder"]

#: Steps kept for the timings (median, p99, wait share).
WINDOW = 256
#: Step time and gradient-sync time are measured on one step in this many (each bucket's Future timed through a
#: ``then``, which costs about 20 us a step); for a model on DDP's C++ path, DDP's own runtime statistics.
SAMPLE_EVERY = 10
_wall = time.time  # module globals: one lookup in every step
_monotonic = time.monotonic
#: DDP samples its runtime statistics (the gradient-sync time, for the straggler check) one iteration in this many
#: (its default), and the watch reads the statistic as often: the job pays nothing for the sampling ...
DDP_SAMPLE_RATE = 100
#: ... until a timed step takes this long; from then on DDP samples one iteration in SAMPLE_EVERY and each timed step
#: reads it (every sample: a host's two ranks are told apart from each other on few). A sampled iteration costs DDP
#: about 50 us and a read about 80 us inside a training step (benchmarks/watch_step_pairs.py: 5 us a step on a 0.7 ms
#: step at one in 10), under 0.3% of ten steps this long.
LONG_STEP_S = 5e-3


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Live:
    """The current watch's recorder (None: no watch, or no process group yet), read by the patched functions on the
    per-step path as an attribute (one call less in every step), and its point-to-point book once the per-call path
    may use it (``p2p``: None until the recorder learned how the group counts these calls)."""

    __slots__ = ("p2p", "recorder")

    def __init__(self) -> None:
        self.recorder: Recorder | None = None
        self.p2p: P2PBook | None = None


class Recorder(Calls):
    """This rank's progress. ``enter`` / ``complete`` around every collective (``Calls``), ``step`` at each DDP
    forward, ``phase_begin`` / ``phase_end`` around marked phases; ``record()`` is what the monitor publishes."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = socket.gethostname().split(".", 1)[0]
        super().__init__()
        self._lock = threading.Lock()
        self.steps = 0
        self.step_at = 0.0
        """When step ``steps`` began (epoch seconds; ``watch.steplines`` writes the goodput lines from it)."""
        self.first_step_at = 0.0
        self.loaded_state = False
        """The script loaded saved state (``torch.load``, a model's or optimizer's ``load_state_dict``) before its
        first step: it may have resumed (``goodput.positions``)."""
        self.epochs: list[tuple[int, int, float]] = []
        """(epoch, the step it began before, when): the script's sampler's ``set_epoch`` calls, each new epoch once
        (``watch.steplines`` writes them: where a resumed script went on from, ``goodput.positions``)."""
        self.sync_total = 0.0  # the sampled gradient-sync times, summed, and how many (``watch.steplines``)
        self.sync_samples = 0
        self._step_start: float | None = None
        self._began = 0.0  # when the current step began (monotonic)
        self.longest: tuple[float, int] = (0.0, 0)
        """The longest step after the first, every step measured (the percentiles come from one step in SAMPLE_EVERY,
        and a single stall, a 75 s checkpoint, is in none of them): seconds, and its number as the watch's reports
        give it (counted from 0, as a script's loop: the step begun by the k-th forward is step k - 1)."""
        self.step_times: deque[float] = deque(maxlen=WINDOW)
        self.sync_times: deque[float] = deque(maxlen=WINDOW)
        self.sampling = False
        """This step's gradient buckets are timed (one step in SAMPLE_EVERY, hooked models)."""
        self._intervals: list[tuple[float, float]] = []
        self.phases: list[tuple[str, float, float | None, int | None]] = []
        """Marked phases, innermost last: name, since (monotonic), deadline (s, or None), deadline index."""
        self.deadline_phases = 0
        self.stage: tuple[int, str, bool] | None = None
        """The latest phase begun with a deadline: its index (0, 1, ... in the order begun), name, whether done."""
        self._group: Any = None  # the process group of a model on DDP's C++ path: its collectives are counted
        self._ddp: weakref.ref[Any] | None = None
        self._counter: Any = None  # ddpkit's own hook on that model, when its calls bypass the group (MPI)
        self.counted_as = "DDP's gradient all-reduce on its C++ path"
        """What the counted collectives are, in a report."""
        self._sample_end = 0
        self._rate = DDP_SAMPLE_RATE  # DDP's sample rate now
        self._read_at = 0  # the step at which DDP's statistic was last read

    def count_group(self, model: Any, counter: Any = None) -> None:
        """``model`` (DDP, no Python hook) stays on DDP's C++ all-reduce path: its all-reduces are counted by the
        process group's own sequence number, which counts every collective on the group, and its gradient-sync time
        is DDP's own ``backward_comm_time`` (first bucket's all-reduce to the last one's end), sampled one iteration
        in DDP_SAMPLE_RATE, or in SAMPLE_EVERY once steps take LONG_STEP_S (``_sample``). ``counter``: ddpkit's
        own hook on the model (``comm/gradients.GradientAveraging``: ``issued``, ``bypasses_group``, ``about``), whose
        collectives the group counts, or which counts them itself where they bypass the group."""
        model._set_ddp_runtime_logging_sample_rate(DDP_SAMPLE_RATE)
        self._rate = DDP_SAMPLE_RATE
        self._ddp = weakref.ref(model)
        self._group = model.process_group
        if counter is not None:
            self._counter = counter if counter.bypasses_group else None
            self.counted_as = counter.about

    def forget_group(self) -> None:
        """The default group is being re-formed in this process (``--heal live``): no reference to it is kept (one
        would keep gloo's connections open, and a peer blocked on one would wait out the group's timeout); the
        model re-wrapped over the new group is counted again from its next forward (``watch.regroup``)."""
        self._group, self._ddp, self._counter = None, None, None
        self.p2p.world = None

    def group_seq(self) -> int | None:
        """The process group's count of collectives issued on this rank (C++ ones included), plus the calls of a
        hook that bypass the group; None: not counted."""
        group = self._group
        if group is None:
            return None
        counter = self._counter
        world = self.p2p.world
        base = self.p2p_first_base if group is world else None
        issued = int(group._get_sequence_number_for_group()) if base is None else base
        issued += counter.issued if counter is not None else 0
        return issued - self.p2p_in_group() if group is world else issued

    def _sampled_sync(self) -> float | None:
        """The latest sampled iteration's gradient-sync time (s), once per new sample."""
        model = self._ddp() if self._ddp is not None else None
        if model is None:
            return None
        data = model._get_ddp_logging_data()
        end = int(data.get("backward_comm_time_end", 0) or 0)
        if end == 0 or end == self._sample_end:
            return None
        self._sample_end = end
        return float(data.get("backward_comm_time", 0)) / 1e9

    def bucket_done(self, since: float) -> None:
        """A timed gradient bucket's Future completed (on the backend's thread)."""
        self._intervals.append((since, time.monotonic()))

    # -- steps and phases -------------------------------------------------------------------------------------
    def step(self) -> None:
        """A DDP forward began: the previous step (forward, backward, gradient sync, optimizer) ended, and DDP
        waited for each of its gradient buckets. Runs in every step, where each line costs (benchmarks/
        watch_step_pairs.py: the whole method cost 7 us in place when it timed every step): steps are counted here,
        and timed one in SAMPLE_EVERY (``_sample``)."""
        if self._open:  # the last step's buckets: DDP waited for each (a failed one raised in backward: no step)
            for call in list(self._open.values()):
                fut = call[2]
                if fut is not None and fut.done():
                    # a script's own async collective may have failed unseen (one never waited for raises nowhere)
                    error = None if call[4] else future_error(fut)
                    if error is None:
                        self._open.pop(call[3], None)
                    else:
                        self.fail(call, error)
        n = self.steps + 1
        now = _monotonic()
        if now - self._began > self.longest[0] and n > 2:  # the step begun by forward n - 1 ended
            self.longest = (now - self._began, n - 2)
        self._began = now
        self.step_at = _wall()
        self.steps = n
        if n % SAMPLE_EVERY <= 1:
            self._sample(n)

    def epoch_began(self, epoch: int) -> None:
        """The script's sampler was told ``epoch`` (``DistributedSampler.set_epoch``): the next DDP forward is its
        first step. A second sampler told the same epoch (an evaluation's) adds nothing."""
        if not self.epochs or self.epochs[-1][0] != epoch:
            self.epochs.append((epoch, self.steps + 1, _wall()))

    def state_loaded(self) -> None:
        if not self.steps:
            self.loaded_state = True

    def _sample(self, n: int) -> None:
        """Step ``n`` begins, one in SAMPLE_EVERY is timed: the one that begins at n = 0 (mod SAMPLE_EVERY) ends at
        the next forward. Its wall time; for a model with a Python hook, its gradient-sync time (the union of its
        buckets' times in flight, timed while ``sampling``); for a model on DDP's C++ path (or ddpkit's own hook),
        DDP's own statistic (``_sampled_sync``)."""
        now = time.monotonic()
        if n == 1:
            self.first_step_at = self.step_at
        if n % SAMPLE_EVERY == 1:
            start, self._step_start = self._step_start, None
            took = now - start if start is not None else 0.0
            if start is not None:
                self.step_times.append(took)
            sampled = None if self._ddp is None else self._ddp_sync(n, took)
            if self._intervals:
                sampled, self._intervals = _union(self._intervals), []
            if sampled is not None:
                self.sync_times.append(sampled)
                self.sync_total += sampled
                self.sync_samples += 1
            self.sampling = False
        else:
            self._step_start = now
            self.sampling = self._ddp is None

    def _ddp_sync(self, n: int, took: float) -> float | None:
        """At step ``n``'s timed predecessor's end (``took`` s): DDP's sample rate for the step's length, and its
        statistic when a new sample is due. Read here, not on the watch's thread: it takes the Reducer's lock, which
        the main thread holds in backward, while holding the GIL (the rank's heartbeat stopped: tried, and named
        stopped)."""
        rate = SAMPLE_EVERY if took >= LONG_STEP_S else DDP_SAMPLE_RATE
        model = self._ddp() if self._ddp is not None else None
        if model is None:
            return None
        if rate != self._rate:
            model._set_ddp_runtime_logging_sample_rate(rate)
            self._rate = rate
        if n - self._read_at < rate:
            return None
        self._read_at = n
        return self._sampled_sync()

    def phase_begin(self, name: str, deadline: float | None = None) -> None:
        with self._lock:
            index = None
            if deadline is not None:
                index, self.deadline_phases = self.deadline_phases, self.deadline_phases + 1
                self.stage = (index, name, False)
            self.phases.append((name, time.monotonic(), deadline, index))

    def phase_end(self) -> None:
        with self._lock:
            if self.phases:
                name, _, _, index = self.phases.pop()
                if index is not None:
                    self.stage = (index, name, True)

    def overdue(self) -> tuple[int, str, float, float] | None:
        """This rank's innermost phase with a deadline, when it has passed it: index, name, deadline, seconds in."""
        now = time.monotonic()
        with self._lock:
            for name, since, deadline, index in reversed(self.phases):
                if deadline is not None and index is not None:
                    return (index, name, deadline, now - since) if now - since > deadline else None
        return None

    # -- what the monitor publishes ---------------------------------------------------------------------------
    def timings(self) -> Timings:
        """``steps`` begun, ``timed`` (one in SAMPLE_EVERY), their p50 / p99 / mean, the gradient-sync samples, and the
        longest step after the first (``step_max``, its number ``step_max_at``), once one ended."""
        with self._lock:
            steps, syncs = list(self.step_times), list(self.sync_times)
        longest, at = self.longest
        out: Timings = {"steps": self.steps, "timed": len(steps)}
        if at:
            out["step_max"], out["step_max_at"] = longest, at
        if steps:
            out["step_p50"], out["step_p99"] = _percentile(steps, 0.5), _percentile(steps, 0.99)
            out["step_mean"] = sum(steps) / len(steps)
            out["sync_samples"] = len(syncs)
            out["sync_p50"] = _percentile(syncs, 0.5) if syncs else 0.0
            out["sync_mean"] = sum(syncs) / len(syncs) if syncs else 0.0
        return out

    def record(self, beat: int, *, final: bool = False) -> Heartbeat:
        self.sweep()
        requests = self.p2p.requests
        for work in list(requests):
            if sys.getrefcount(work) <= 4:  # this dict, the list, ``work`` and the argument: nobody can wait on it
                requests.pop(work, None)
        now = time.monotonic()
        entered = self.entered
        calls = [c for c in list(self._open.values()) if c[3] <= entered]
        oldest = min(calls, key=lambda c: c[3], default=None)
        with self._lock:
            phase = self.phases[-1] if self.phases else None
        group_seq = self.group_seq()
        out: Heartbeat = {
            "rank": self.rank, "host": self.host, "pid": os.getpid(), "beat": beat, "entered": entered,
            # the calls that returned, point-to-point ones included: the monitor's measure of progress (a healthy
            # send / recv exchange makes no collective progress)
            "completed": entered - len(calls) + self.p2p.returned, "step": self.steps,
            "first_step_done": self.steps > 1,
            "recent": [[seq, *about] for seq, about in list(self._recent)],
            # the oldest open collective, else the point-to-point call this rank blocks in (it has ``peers``)
            "waiting": self.p2p_waiting(now) if oldest is None else {
                "seq": oldest[3], "op": oldest[0][0], "bytes": oldest[0][1], "site": oldest[0][2],
                "for": round(now - oldest[1], 3)},
            "phase": None if phase is None else {"name": phase[0], "for": round(now - phase[1], 3),
                                                 "deadline": phase[2]},
            "stage": None if self.stage is None else list(self.stage),
            "final": final, "failed": self.failed is not None, "group_seq": group_seq, "timings": self.timings(),
        }
        if self.p2p.returned or any(state.call is not None for state in list(CALLERS.values())):
            out["p2p"] = {direction: {str(peer): n for peer, n in posted.items()}
                          for direction, posted in self.p2p_posted.items()}
        if group_seq is not None:
            out["counted_as"] = self.counted_as
        return out


def _union(intervals: list[tuple[float, float]]) -> float:
    """The time covered by some interval (a gradient bucket in flight)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
