"""From a run's records to where its wall-clock time went: pure (no files, no clocks, no torch).

The wall clock runs from the run's start (the batch job's submission where the scheduler said, ``QueueWaited``;
else the supervisor's process start, ``RunStarted``; else the first attempt's) to the last attempt's end, and
every second of it lands in exactly one category:

- ``queue_wait``: from the job's submission to its start, as the scheduler recorded them (Slurm's SubmitTime and
  StartTime, ``goodput.queue``); 0 where no scheduler said;
- ``startup``: before the first attempt (after the queue), and in each attempt from its start to its first step
  (imports, rendezvous, the process group, wrapping the model), less the snapshot load;
- ``checkpoint_load`` and ``checkpoint_save``: the time the training thread was held by them;
- ``training``: inside the steps that made progress, less the straggler wait in them; ``lost_progress``: inside
  the steps that did again what an earlier attempt had done (a step at or below the furthest point reached before,
  ``goodput.positions``: a step's number for ``train``, its epoch and place in it for a user's script), counted
  by step. Where that cannot be known (a user's script that showed no epoch), the steps are counted as training
  and the split says so (``lost_steps`` None): its goodput is then an upper bound, never a lost step invented;
- ``straggler_wait``: inside the steps that made progress, the time the quickest rank waited in the gradient sync
  for the slowest (``goodput.straggler``: max - min over ranks of the measured sync time per step), from the
  other ranks' ``Steps`` lines (0 without them, or where the sync was not measured);
- ``loop_other``: the loop's own time between steps (data, the epoch's loss line, the stop vote);
- ``live_heal``: under ``--heal live``, from a rank lost to its replacement's first step (the ledger's
  ``RankReplaced``): the survivors kept their processes and lost no step, but trained nothing while they waited;
- ``failure``: in a failed attempt, from its last record to its end: the hang until detection, and teardown;
- ``teardown``: in an attempt that finished, from its last record to its end (the process group's end, exit);
- ``relaunch``: between one attempt's end and the next one's start;
- ``unmeasured``: an attempt whose rank 0 wrote nothing (a script under ``ddpkit run --no-watch``, or one without a
  DDP model: ``ddpkit run``'s lines are the watch's count of DDP forwards, ``watch.steplines``).

So the categories add up to the wall clock by construction (``loop_other`` is the remainder inside the loop; a
negative remainder, which only clocks that disagree make, is clipped and shows as a sum that misses the wall).
goodput = training / wall clock, overall and per window of ``window_s``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddpkit.goodput.positions import GLOBAL, Placement, epoch_length, numbered_per_attempt, place
from ddpkit.goodput.records import (
    EpochBegan,
    Finished,
    GoodputRecord,
    Loaded,
    QueueWaited,
    RankStarted,
    RunStarted,
    Saved,
    Steps,
)
from ddpkit.goodput.straggler import attempt_wait, window_wait

__all__ = ["AttemptAccount", "AttemptSpan", "Category", "Split", "account"]


class Category(enum.Enum):
    QUEUE_WAIT = "queue_wait"
    STARTUP = "startup"
    CHECKPOINT_LOAD = "checkpoint_load"
    TRAINING = "training"
    LOST_PROGRESS = "lost_progress"
    STRAGGLER_WAIT = "straggler_wait"
    CHECKPOINT_SAVE = "checkpoint_save"
    LOOP_OTHER = "loop_other"
    LIVE_HEAL = "live_heal"
    FAILURE = "failure"
    TEARDOWN = "teardown"
    RELAUNCH = "relaunch"
    UNMEASURED = "unmeasured"

    @property
    def words(self) -> str:
        return _WORDS[self]


_WORDS = {Category.QUEUE_WAIT: "queue wait (the scheduler's)", Category.STARTUP: "start-up (imports, rendezvous)",
          Category.CHECKPOINT_LOAD: "checkpoint load",
          Category.TRAINING: "training steps", Category.LOST_PROGRESS: "lost progress (steps done again)",
          Category.STRAGGLER_WAIT: "waiting for a straggler",
          Category.CHECKPOINT_SAVE: "checkpoint save", Category.LOOP_OTHER: "loop between steps",
          Category.LIVE_HEAL: "live heal (a rank lost to its replacement's first step; no step lost)",
          Category.FAILURE: "hang until detection, teardown", Category.TEARDOWN: "teardown after the last step",
          Category.RELAUNCH: "relaunch between attempts",
          Category.UNMEASURED: "inside an attempt with no rank records (a user's script)"}


@dataclass(frozen=True, kw_only=True)
class AttemptSpan:
    """One attempt as its supervisor saw it (the heal ledger's start and end), or as rank 0's records show it."""

    attempt: int
    start: float
    end: float | None
    """None: the attempt has no recorded end (running, or its supervisor was killed): its last record ends it."""
    exit_code: int | None = None
    cause: str = ""
    """The classification's reason, in words ("" for a success)."""
    failure_class: str | None = None
    hosts: tuple[str, ...] = ()
    heals: tuple[tuple[float, float], ...] = ()
    """Under ``--heal live``: (a rank lost, its replacement's first step) for each rank replaced in the attempt."""


@dataclass(kw_only=True)
class AttemptAccount:
    attempt: int
    start: float
    end: float
    exit_code: int | None
    cause: str
    failure_class: str | None
    seconds: dict[Category, float]
    first_step: int | None = None
    last_step: int | None = None
    resumed_from: int | None = None
    lost_steps: int | None = 0
    """Steps done again; None: not known (a user's script whose resume point it did not show)."""
    reached: int | None = None
    """The furthest point of the run's training this attempt reached (``goodput.positions``); None: not known."""
    steps: list[Steps] = field(default_factory=list)
    done_again: list[int | None] = field(default_factory=list)
    """How many of each of ``steps`` an earlier attempt had done (None: not known)."""
    waits: list[float] = field(default_factory=list)
    """The straggler wait inside each of ``steps`` (its steps that made progress), seconds."""
    saves: list[Saved] = field(default_factory=list)
    loads: list[Loaded] = field(default_factory=list)
    first_step_at: float | None = None
    """When this attempt's first step began (the end of its start-up)."""
    placement: Placement | None = GLOBAL
    """Where its steps lie on the run's axis (None: not known)."""
    before: int | None = 0
    """The furthest point reached before this attempt (None: not known)."""
    heals: tuple[tuple[float, float], ...] = ()
    """(lost, back) of each live heal inside it (``AttemptSpan.heals``, clipped to the attempt)."""

    def again(self, first: int, last: int) -> int | None:
        """How many of its steps ``first..last`` (any rank's) an earlier attempt had done; None: not known."""
        if self.before == 0:  # nothing done before: nothing done again, wherever the steps lie
            return 0
        if self.before is None or self.placement is None:
            return None
        return self.placement.done_again(first, last, self.before)


@dataclass(kw_only=True)
class Split:
    start: float
    end: float
    seconds: dict[Category, float]
    attempts: list[AttemptAccount]
    windows: list[tuple[float, float]]
    """(window start, goodput in that window), one per ``window_s``."""
    window_s: float
    lost_steps: int | None
    """Steps done again over the run; None: not known for some attempt (its training time is an upper bound)."""
    furthest_step: int | None
    queue: QueueWaited | None = None

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def accounted_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def lost_known(self) -> bool:
        return self.lost_steps is not None

    @property
    def measured(self) -> bool:
        """Whether any rank recorded its steps: a run whose ranks wrote none (a user's script with the watch off,
        as under ``run --heal live``) has a goodput that is not known, never 0."""
        return any(a.last_step is not None for a in self.attempts)

    @property
    def live_heals(self) -> int:
        """Ranks replaced live over the run."""
        return sum(len(a.heals) for a in self.attempts)

    @property
    def goodput(self) -> float:
        return self.seconds[Category.TRAINING] / self.wall_s if self.wall_s > 0 else 0.0


def _zero() -> dict[Category, float]:
    return dict.fromkeys(Category, 0.0)


def _by_attempt(records: Sequence[GoodputRecord]) -> dict[int, list[GoodputRecord]]:
    out: dict[int, list[GoodputRecord]] = {}
    for r in records:
        if not isinstance(r, RunStarted | QueueWaited):
            out.setdefault(r.attempt, []).append(r)
    return out


def _last_time(records: Sequence[GoodputRecord]) -> float | None:
    times = [r.end if isinstance(r, Loaded | Steps | Saved) else r.time for r in records
             if not isinstance(r, RunStarted | QueueWaited)]
    return max(times, default=None)


def _spans_from_records(by_attempt: dict[int, list[GoodputRecord]]) -> list[AttemptSpan]:
    """Without a heal ledger (``ddpkit train --run-dir`` under torch elastic's restarts): an attempt from its rank 0's
    process start to its last record."""
    spans = []
    for number, recs in sorted(by_attempt.items()):
        started = [r for r in recs if isinstance(r, RankStarted)]
        start = min((r.process for r in started), default=None)
        last = _last_time(recs)
        if start is None or last is None:
            continue
        done = [r for r in recs if isinstance(r, Finished)]
        spans.append(AttemptSpan(attempt=number, start=start, end=last, exit_code=0 if done else None,
                                 cause="" if done else "no record after the last step"))
    return spans


def account(attempts: Sequence[AttemptSpan], records: Sequence[GoodputRecord], *, window_s: float = 60.0,
            now: float | None = None, rank_steps: Mapping[int, Sequence[Steps]] | None = None) -> Split:
    """The run's split. ``attempts``: the heal ledger's (empty: derived from ``records``); ``now``: the end of an
    attempt with no recorded end and no records (a run still starting); ``rank_steps``: the other ranks' step lines
    (``goodput.rank-R.jsonl``), for the straggler wait."""
    by_attempt = _by_attempt(records)
    spans = sorted(attempts or _spans_from_records(by_attempt), key=lambda a: a.start)
    if not spans:
        raise ValueError("no attempt recorded: nothing to account for")
    run_starts = [r.time for r in records if isinstance(r, RunStarted)]
    launched = min([*run_starts, spans[0].start])
    queue = next((r for r in records if isinstance(r, QueueWaited) and r.submit <= r.start), None)
    start = min(launched, queue.submit) if queue is not None else launched
    total = _zero()
    queue_end = min(queue.start, launched) if queue is not None else start
    total[Category.QUEUE_WAIT] += queue_end - start
    total[Category.STARTUP] += spans[0].start - queue_end
    others: dict[int, dict[int, list[Steps]]] = {}
    for rank, lines in (rank_steps or {}).items():
        if rank != 0:
            for r in lines:
                others.setdefault(r.attempt, {}).setdefault(rank, []).append(r)
    accounts: list[AttemptAccount] = []
    furthest: int | None = 0  # None: not known (an attempt whose steps could not be placed)
    unseen = False  # an attempt ran and left no step lines
    epochs = {r.epoch for r in records if isinstance(r, EpochBegan)}
    length = epoch_length(records)
    previous_end = start
    for index, span in enumerate(spans):
        recs = by_attempt.get(span.attempt, [])
        end = span.end if span.end is not None else (_last_time(recs) or now or span.start)
        if index:
            total[Category.RELAUNCH] += max(0.0, span.start - previous_end)
        # an earlier attempt that left no step lines may have made steps ddpkit did not see: where steps are
        # numbered per attempt (a user's script), what was done before is then not known, never taken as nothing
        before = None if unseen and numbered_per_attempt(recs) else furthest
        one = _attempt(span, end, recs, before, others.get(span.attempt, {}), length, len(epochs) <= 1)
        accounts.append(one)
        for category, seconds in one.seconds.items():
            total[category] += seconds
        if one.steps:
            furthest = None if before is None or one.reached is None else max(before, one.reached)
        elif end > span.start:
            unseen = True
        previous_end = end
    lost = [a.lost_steps for a in accounts]
    split = Split(start=start, end=previous_end, seconds=total, attempts=accounts, windows=[], window_s=window_s,
                  lost_steps=None if None in lost else sum(n for n in lost if n is not None), furthest_step=furthest,
                  queue=queue)
    split.windows = _windows(split, window_s)
    return split


def _attempt(span: AttemptSpan, end: float, recs: list[GoodputRecord], furthest: int | None,
             others: Mapping[int, Sequence[Steps]], length: int | None, one_epoch: bool) -> AttemptAccount:
    steps = sorted((r for r in recs if isinstance(r, Steps)), key=lambda r: r.start)
    saves = [r for r in recs if isinstance(r, Saved)]
    loads = [r for r in recs if isinstance(r, Loaded)]
    finished = [r for r in recs if isinstance(r, Finished)]
    seconds = _zero()
    if not recs:
        seconds[Category.UNMEASURED] = max(0.0, end - span.start)
        return AttemptAccount(attempt=span.attempt, start=span.start, end=end, exit_code=span.exit_code,
                              cause=span.cause, failure_class=span.failure_class, seconds=seconds,
                              heals=span.heals)  # its heals known from the ledger, their time inside UNMEASURED
    load = sum(r.end - r.start for r in loads)
    save = sum(r.end - r.start for r in saves)
    busy = sum(r.busy_s for r in steps)
    placement = place(recs, steps, length, one_epoch)
    where = AttemptAccount(attempt=span.attempt, start=span.start, end=end, exit_code=span.exit_code, cause=span.cause,
                           failure_class=span.failure_class, seconds=seconds, placement=placement, before=furthest)
    again = [where.again(r.first, r.last) for r in steps]
    lost = sum(r.busy_s * (n or 0) / r.count for r, n in zip(steps, again, strict=True))
    # the attempt's wait (``straggler.attempt_wait``), shared among its windows as their own spreads show it; the
    # wait inside steps done again is already lost progress: only the useful steps' share is counted here
    spreads = [window_wait(r, others) for r in steps]
    scale = attempt_wait(steps, others) / sum(spreads) if sum(spreads) > 0 else 0.0
    waits = [min(r.busy_s, w * scale) * (r.count - (n or 0)) / r.count
             for r, w, n in zip(steps, spreads, again, strict=True)]
    last_record = _last_time(recs)
    activity_end = min(end, last_record) if last_record is not None else span.start
    seconds[Category.CHECKPOINT_LOAD] = load
    seconds[Category.CHECKPOINT_SAVE] = save
    seconds[Category.TRAINING] = busy - lost - sum(waits)
    seconds[Category.LOST_PROGRESS] = lost
    seconds[Category.STRAGGLER_WAIT] = sum(waits)
    heals = tuple((max(lost, span.start), min(back, end)) for lost, back in span.heals if back > lost)
    if steps:
        first_at = steps[0].start
        seconds[Category.STARTUP] = max(0.0, first_at - span.start - load)
        between = max(0.0, activity_end - first_at - busy - save)
        seconds[Category.LIVE_HEAL] = min(between, sum(back - lost for lost, back in heals))  # inside the loop
        seconds[Category.LOOP_OTHER] = between - seconds[Category.LIVE_HEAL]
    else:
        first_at = None
        seconds[Category.STARTUP] = max(0.0, activity_end - span.start - load - save)
    tail = max(0.0, end - activity_end)
    ok = bool(finished) and (span.exit_code in (None, 0) or finished[-1].outcome != "completed")
    seconds[Category.TEARDOWN if ok else Category.FAILURE] = tail
    resumed = next((r.step for r in loads if r.step is not None), None)
    if resumed is None and placement is not None and steps and numbered_per_attempt(recs):
        resumed = placement.reached(steps[0].first, steps[0].first) - 1 or None  # the point its script went on from
    return AttemptAccount(attempt=span.attempt, start=span.start, end=end, exit_code=span.exit_code,
                          cause=span.cause, failure_class=span.failure_class, seconds=seconds,
                          first_step=steps[0].first if steps else None, last_step=max((r.last for r in steps),
                                                                                      default=None),
                          resumed_from=resumed, lost_steps=None if None in again else sum(n or 0 for n in again),
                          reached=None if placement is None else max((placement.reached(r.first, r.last)
                                                                      for r in steps), default=0),
                          steps=steps, done_again=again, waits=waits, saves=saves, loads=loads, first_step_at=first_at,
                          placement=placement, before=furthest, heals=heals)


def _windows(split: Split, width: float) -> list[tuple[float, float]]:
    """Goodput per window: the training time inside it (a ``Steps`` line's progress spread evenly over its span)."""
    if width <= 0 or split.wall_s <= 0:
        return []
    count = max(1, int(-(-split.wall_s // width)))
    trained = [0.0] * count
    for attempt in split.attempts:
        for r, wait, again in zip(attempt.steps, attempt.waits, attempt.done_again, strict=True):
            useful = r.busy_s * (r.count - (again or 0)) / r.count - wait
            span = max(r.end - r.start, 1e-9)
            for i in range(count):
                lo = split.start + i * width
                overlap = min(r.end, lo + width) - max(r.start, lo)
                if overlap > 0 or (span <= 1e-9 and lo <= r.start < lo + width):
                    trained[i] += useful * (min(1.0, max(overlap, 0.0) / span) if span > 1e-9 else 1.0)
    out = []
    for i in range(count):
        lo = split.start + i * width
        length = min(width, split.end - lo)
        out.append((lo, trained[i] / length if length > 0 else 0.0))
    return out
