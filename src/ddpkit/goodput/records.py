"""The goodput ledger's lines, ``RUN_DIR/goodput.jsonl`` (beside the heal ledger, ``ledger.jsonl``), and the ranks'
writer.

Who writes what: the one-host supervisor (``ddpkit run|train -n N --heal``) a ``RunStarted`` line with its
process's start (imports included) and tells its ranks the run directory and the attempt number through
``DDPKIT_RUN_DIR`` and ``DDPKIT_ATTEMPT``; ``ddpkit train``'s rank 0 (with ``--run-dir`` or under ``--heal``)
a ``RankStarted`` line, the snapshot it loaded (``Loaded``), one ``Steps`` line per second of training (or per
window of ``every_s``: never a line per step), each snapshot it saved (``Saved``) and, where it finished,
``Finished``; every other rank R its own ``Steps`` lines in ``goodput.rank-R.jsonl`` (per-rank step times for
the report, and the straggler wait: ``goodput.straggler``); under Slurm, rank 0 the job's queue wait once
(``QueueWaited``, ``goodput.queue``). Lines are written and read by ``base.jsonlines`` (one whole fsynced line
each): a job killed at any moment keeps every line it wrote, and at most one torn last line, which reading skips.

The attempts themselves (their start and end, their cause) are the heal ledger's; ``accounting`` joins the two.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from ddpkit.base.jsonlines import Kinds, append_line, encode, record

__all__ = ["ATTEMPT_VAR", "GOODPUT", "RUN_DIR_VAR", "EpochBegan", "Finished", "GoodputLog", "GoodputRecord",
           "Loaded", "QueueWaited", "RankStarted", "RunStarted", "Saved", "Steps", "append_line",
           "attempt_from_environ", "rank_file", "read_goodput", "run_dir_from_environ"]

GOODPUT = "goodput.jsonl"


def rank_file(rank: int) -> str:
    """Where a rank other than 0 writes its own ``Steps`` lines (its step times; nothing else)."""
    return f"goodput.rank-{rank}.jsonl"


#: Set by the supervisor for its ranks: where the run's ledgers are, and the attempt the ranks belong to.
RUN_DIR_VAR = "DDPKIT_RUN_DIR"
ATTEMPT_VAR = "DDPKIT_ATTEMPT"


@record("run-started")
class RunStarted:
    """The supervisor's process began (``time``: the process's start, before its imports)."""

    time: float
    pid: int
    host: str


@record("rank-started")
class RankStarted:
    """Rank 0 of an attempt is ready to load its snapshot."""

    attempt: int
    time: float
    """When rank 0 wrote this line (imports, rendezvous and the process group are behind it)."""
    process: float
    """When rank 0's process started (a restarted worker group's: its fork)."""
    pid: int
    host: str
    world_size: int
    numbering: str = "global"
    """How the attempt's ``Steps`` are numbered: ``"global"``, across attempts (``train``: a resumed attempt goes on
    from its snapshot's step); ``"attempt"``, from 1 in every attempt (a user's script under ``ddpkit run``: the watch
    counts its DDP forwards and cannot see its checkpoint; where it resumed is told by its ``EpochBegan`` lines)."""
    loaded_state: bool | None = None
    """A user's script loaded saved state (``torch.load``, a model's or optimizer's ``load_state_dict``) before its
    first step; None: not watched (``train``, whose ``Loaded`` says)."""


@record("epoch-began")
class EpochBegan:
    """A user's script began epoch ``epoch`` (it called its sampler's ``set_epoch``) before its step ``step`` of
    this attempt (numbered from 1 in each attempt: ``RankStarted.numbering``)."""

    attempt: int
    epoch: int
    step: int
    time: float


@dataclass(frozen=True, kw_only=True)
class _Span:
    """What rank 0 of attempt ``attempt`` spent from ``start`` to ``end`` (epoch seconds): the base of the records
    that take time (a load, steps, a save)."""

    attempt: int
    start: float
    end: float


@record("loaded")
class Loaded(_Span):
    """The snapshot the ranks agreed on was loaded (``step``: its global step; None: none, a fresh start)."""

    step: int | None


@record("steps")
class Steps(_Span):
    """Training steps ``first``..``last`` (global, 1-based), from the start of the first to the end of the last;
    ``busy_s``: the time inside the steps (the rest of the span is the loop's own: data, epoch ends)."""

    first: int
    last: int
    busy_s: float
    p50_ms: float
    """The rank's median step time in the window."""
    rank: int = 0
    """The rank whose steps these are: rank 0's are in ``goodput.jsonl``, another rank's in its own file."""
    sync_s: float | None = None
    """The window's time in the gradient sync: per step, from the moment this rank handed its last gradient bucket
    to the all-reduce (its own backward done) to the moment its backward returned (the all-reduce complete): the
    transfer, plus the wait for ranks slower than this one. None: not measured (DDP's own C++ all-reduce, one
    rank, a ledger written before this field)."""

    @property
    def count(self) -> int:
        return self.last - self.first + 1


@record("queue-waited")
class QueueWaited:
    """The batch scheduler's word on the job's queue wait (``goodput.queue``: Slurm's SubmitTime and StartTime),
    written once per scheduler job by rank 0 of the first attempt that could read it."""

    scheduler: str
    job_id: str
    submit: float
    start: float


@record("saved")
class Saved(_Span):
    """A snapshot of ``step``: the time the training thread was held by it (an async one: its in-memory copy)."""

    step: int


@record("finished")
class Finished:
    """Rank 0's loop ended (completed, or stopped by a preemption signal): ``outcome`` as ``RunOutcome.value``."""

    attempt: int
    time: float
    step: int
    outcome: str


GoodputRecord = RunStarted | RankStarted | EpochBegan | Loaded | Steps | Saved | Finished | QueueWaited
_KINDS: Kinds[GoodputRecord] = Kinds("goodput", (RunStarted, RankStarted, EpochBegan, Loaded, Steps, Saved,
                                                 Finished, QueueWaited))
to_json = encode


def from_json(line: str) -> GoodputRecord:
    """The record of one line; ValueError for a line that is not one (a torn write, an unknown kind)."""
    return _KINDS.decode(line)


def read_goodput(path: str | Path) -> list[GoodputRecord]:
    """Every record of a goodput file (or of ``RUN_DIR/goodput.jsonl`` for a directory), oldest first; a torn last
    line is skipped; a missing file is an empty ledger."""
    path = Path(path)
    return _KINDS.read(path / GOODPUT if path.is_dir() else path)


def run_dir_from_environ() -> str | None:
    return os.environ.get(RUN_DIR_VAR) or None


def attempt_from_environ(restart_count: int) -> int:
    """The attempt a rank belongs to: the supervisor's number, else torch elastic's restarts + 1."""
    try:
        return int(os.environ[ATTEMPT_VAR])
    except (KeyError, ValueError):
        return restart_count + 1


class GoodputLog:
    """A rank's writer (rank 0: the run's events and its steps; another rank: its steps alone, in its own file).
    Steps are gathered in memory and written once per ``every_s`` seconds (one fsynced line), so a step costs two
    clock reads and a few additions; checkpoints, loads and the end are written when they happen.

    ``flush()`` writes the steps not yet written (the trainer calls it on every way out of its loop)."""

    def __init__(self, run_dir: str | Path, *, attempt: int, every_s: float = 1.0, rank: int = 0) -> None:
        self.path = Path(run_dir) / (GOODPUT if rank == 0 else rank_file(rank))
        self.attempt, self.every_s, self.rank = attempt, every_s, rank
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._times: list[float] = []
        self._start = self._end = 0.0
        self._first = self._last = 0
        self._sync = 0.0
        self._synced = False

    def write(self, record: GoodputRecord) -> None:
        """Append ``record``; another rank than 0 keeps only its steps (the run's events are rank 0's)."""
        if self._fd is not None and (self.rank == 0 or isinstance(record, Steps)):
            append_line(self._fd, to_json(record))

    def started(self, *, time: float, process: float, world_size: int) -> None:
        self.write(RankStarted(attempt=self.attempt, time=time, process=process, pid=os.getpid(),
                               host=socket.gethostname().split(".", 1)[0], world_size=world_size))

    def loaded(self, start: float, end: float, step: int | None) -> None:
        self.write(Loaded(attempt=self.attempt, start=start, end=end, step=step))

    def step(self, start: float, end: float, step: int, sync_s: float | None = None) -> None:
        """Step ``step`` ran from ``start`` to ``end`` (epoch seconds), ``sync_s`` of it in the gradient sync (None:
        not measured)."""
        if not self._times:
            self._start, self._first = start, step
        if sync_s is not None:
            self._sync += sync_s
            self._synced = True
        self._times.append(end - start)
        self._end, self._last = end, step
        if end - self._start >= self.every_s:
            self.flush()

    def saved(self, start: float, end: float, step: int) -> None:
        self.flush()
        self.write(Saved(attempt=self.attempt, start=start, end=end, step=step))

    def finished(self, time: float, step: int, outcome: str) -> None:
        self.flush()
        self.write(Finished(attempt=self.attempt, time=time, step=step, outcome=outcome))

    def flush(self) -> None:
        times = self._times
        if not times:
            return
        ordered = sorted(times)
        self._times = []
        sync = self._sync if self._synced else None
        self._sync, self._synced = 0.0, False
        self.write(Steps(attempt=self.attempt, start=self._start, end=self._end, first=self._first, last=self._last,
                         busy_s=sum(ordered), p50_ms=ordered[len(ordered) // 2] * 1e3, rank=self.rank, sync_s=sync))

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
