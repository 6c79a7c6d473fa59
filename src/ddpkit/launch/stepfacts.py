"""What a job step's output said, from its launcher's events (``ddpkit.launcher_output``): the ranks and their
hosts, the ranks that failed (torch's agent and its "Root Cause" boxes, srun's or mpirun's word on a task or rank),
the watch's report, Slurm's cancellation; and the digest of a failed step, cause first. The screen
(``ddpkit.launch.stepscreen``) feeds it every line and asks for the digest at the end. Pure but for the kernel's
log, read for a rank the OOM killer may have ended."""

from __future__ import annotations

import re
import signal
import socket
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ddpkit.base.errors import EXIT_MISSING, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.launch.digest import RankEnd, cause, is_noise, said, short
from ddpkit.launch.failure import failure_order
from ddpkit.launch.kernlog import oom_line_for
from ddpkit.launcher_output import (
    Cancelled,
    Event,
    JobFailing,
    RankEnded,
    RankOnHost,
    Reader,
    Reading,
    RootCause,
    TasksEnded,
    WatchLine,
    WorkerFailed,
)
from ddpkit.launcher_output.ddpkit_lines import WATCH, rank_prefix
from ddpkit.launcher_output.torch_agent import AGENT_FRAMES, cxx_log, torch_log
from ddpkit.launcher_output.tracebacks import CHAINED, TRACEBACK, last_traceback
from ddpkit.launcher_output.words import rank_list, signal_name
from ddpkit.process.exiting import PEER_GONE

__all__ = ["TAIL_LINES", "WATCH_KEPT", "Failure", "StepFacts", "Task"]

PREEMPTED = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)
#: The watch's lines kept for the digest, the first ones (the digest shows its first report; a long job's
#: periodic reports would grow without bound).
WATCH_KEPT = 2_000
TAIL_LINES = 400
_RANK_ON_HOST = re.compile(r"\brank (\d+) on (?:host )?([\w.\-]+)")


@dataclass
class Failure:
    """A rank the agents reported failed: from torchrun's "Root Cause" box (global rank, host, time) or its
    "failed (exitcode: N) local_rank: L (pid: P)" line, or srun's line for a task of one rank."""

    rank: int | None
    host: str | None
    exitcode: int
    pid: int | None = None
    timestamp: str = ""
    """torchrun's, to the second; "" from srun's lines."""
    seq: int = 0
    """The order its line arrived in: srun reports a task's end as it happens."""
    traceback: str = ""
    """The rank's own traceback, where it wrote torch's error file (``ddpkit run`` does): the box shows it."""
    raised: bool = False
    """Known only by its own traceback, the first of any rank's that no peer caused (MPICH says no rank's exit):
    ``exitcode`` is then the launcher's."""


@dataclass
class Task:
    """One labelled source of lines (srun's task, mpirun's rank; -1: the launcher's own, or an unlabelled
    stream)."""

    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> host, from its [host:rank] lines
    ended_seq: int = 0
    host: str | None = None
    exitcode: int | None = None
    quiet_block: bool = False
    traceback_seq: int = 0
    """When its first Python traceback began (``StepFacts.seq``; 0: none)."""


class StepFacts:
    """The facts of one step's output, line by line (``line``), and its digest (``digest``)."""

    def __init__(self, reader: Reader, *, agents: bool | None, ranks_per_task: int | None) -> None:
        self.reader = reader
        self._agents_run = agents
        self._ranks_per_task = ranks_per_task
        self.cancelled: str | None = None
        """Slurm's line where it cancelled the step or the job (scancel, a requeue, the time limit)."""
        self.tasks: dict[int, Task] = {}
        self.failures: list[Failure] = []
        self.watch: list[tuple[int, str]] = []
        self.errors: set[str] = set()
        """The ``ddpkit: error:`` lines the ranks printed (the screen shows each once)."""
        self.failing = False
        self.seq = 0
        self._started = time.monotonic()

    # -- lines in --------------------------------------------------------------------------------------------
    def line(self, reading: Reading) -> Task:
        """Learn from one line read; its task."""
        self.seq += 1
        number = -1 if reading.source is None else reading.source
        task = self.tasks.setdefault(number, Task())
        if number >= 0 and not task.traceback_seq and reading.text.strip() == TRACEBACK:
            task.traceback_seq = self.seq
        for event in reading.events:
            self._learn(number, task, event)
        return task

    def _learn(self, number: int, task: Task, event: Event) -> None:
        if isinstance(event, RankOnHost):
            task.ranks[event.rank] = event.host
            task.host = task.host or event.host
        elif isinstance(event, WatchLine):
            if len(self.watch) < WATCH_KEPT:
                self.watch.append((number, event.text))
        elif isinstance(event, WorkerFailed):
            self.failing = True
            if not any(f.pid == event.pid for f in self.failures):
                self.failures.append(Failure(rank=None, host=task.host, exitcode=int(event.code or 0), pid=event.pid,
                                             seq=self.seq))
        elif isinstance(event, (RankEnded, TasksEnded)):
            self.failing = True
            for t in event.tasks if isinstance(event, TasksEnded) else (event.rank,):
                other = self.tasks.setdefault(t, Task())
                other.host = event.host or other.host
                other.exitcode, other.ended_seq = event.code, self.seq
        elif isinstance(event, JobFailing):
            self.failing = True
        elif isinstance(event, Cancelled) and self.cancelled is None:
            self.cancelled = event.text
        elif isinstance(event, RootCause):
            self._root_cause(event)

    def _root_cause(self, box: RootCause) -> None:
        """An entry of torchrun's box: the rank, host and time of a failure its agent's line told of (the same
        pid), or a failure of its own."""
        failure = next((f for f in self.failures if box.pid is not None and f.pid == box.pid), None)
        if failure is None:
            failure = Failure(rank=None, host=None, exitcode=int(box.code or 0), pid=box.pid, seq=self.seq)
            self.failures.append(failure)
        failure.rank, failure.host, failure.timestamp = box.rank, box.host, box.time
        failure.traceback = box.traceback or failure.traceback

    # -- the digest ------------------------------------------------------------------------------------------
    def digest(self, code: int, log: str) -> list[str]:
        """The failed step on one screen, cause first: the rank that failed first on its own, with its host and
        words; where ddpkit stopped the ranks (exit 3) or no rank failed on its own, what the watch found first.
        A step Slurm cancelled where no rank failed on its own (a requeue, scancel) is said in one line."""
        for source, event in self.reader.finish():  # a box the step's end cut short
            number = -1 if source is None else source
            self._learn(number, self.tasks.setdefault(number, Task()), event)
        ranks = self._rank_hosts()
        first = self._first_failure(code)
        own = first is not None and first.exitcode not in (-signal.SIGTERM, *PREEMPTED)
        if self.cancelled and not own and not self.watch:
            return [f"ddpkit: Slurm ended the step (srun exit code {code}): {self.cancelled}; its full output: {log}"]
        report = _first_report([text for _, text in self.watch])
        head = f"ddpkit: the {self.reader.unit} failed ({self.reader.program} exit code {code})"
        lines: list[str] = []
        culprit = None
        if first is not None and first.rank is not None:
            where = f" on host {first.host}" if first.host else ""
            how = (f"was killed by {signal_name(-first.exitcode)}" if first.exitcode < 0
                   else "raised first" if first.raised else f"failed first with exit code {first.exitcode}")
            error = self._usage_error(first.rank)
            if error:  # shown once above, as every rank printed it
                lines.append(f"{head}: rank {first.rank}{where} {how}: {error}")
            else:
                lines.append(f"{head}: rank {first.rank}{where} {how}")
                kernel = self._kernel(first)
                lines += [f"    {line}" for line in ([f"the kernel: {kernel}"] if kernel else [])
                          + cause(RankEnd(rank=first.rank, stderr=self._words(first.rank)))]
        elif report:
            culprit = _watch_culprit(report)
            lines.append(f"{head}; the watch found first: {culprit or report[0].removeprefix(WATCH).strip()}")
        elif self.errors:
            lines.append(f"{head}: {sorted(self.errors)[0]}")
        else:  # no rank known to have failed: the step's own last words (its last traceback, else its last lines)
            lines.append(head)
            said_last = "\n".join(line for task in self.tasks.values() for line in task.stderr)
            lines += [f"    {line}" for line in cause(RankEnd(rank=-1, stderr=said_last))] if said_last else []
        lines += self._others(ranks, first.rank if first is not None else None, culprit)
        lines += [f"  {text}" for text in report if text.strip() != culprit]
        lines.append(f"  full output of {self.reader.logs_of}: {log}")
        return lines

    def _others(self, ranks: dict[int, str], shown_first: int | None, culprit: str | None) -> list[str]:
        """The other ranks, those that say the same in one line."""
        named = _RANK_ON_HOST.search(culprit or "")
        groups: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            if rank == shown_first:
                continue
            words = said(self._end(rank), shown_first)
            if not self._agents():  # one task per rank: srun (--kill-on-bad-exit) or mpirun ends the others
                words = words.replace("by the agent", f"by {self.reader.name}")
            error = self._usage_error(rank)
            if error and error not in words:
                words = f"{words}: {error}"
            if named and rank == int(named[1]):  # its words after the report are about the job's end, not why
                words = "the rank the watch named (what it said as the step ended: in the full output)"
            groups.setdefault(words, []).append(rank)
        return [f"  {rank_list(r)} ({_hosts(ranks, r)}): {words}" for words, r in groups.items()]

    def _rank_hosts(self) -> dict[int, str]:
        ranks: dict[int, str] = {}
        for number, task in self.tasks.items():
            for rank, host in task.ranks.items():
                ranks.setdefault(rank, host)
            if not task.ranks and number >= 0 and task.exitcode is not None and not self._agents():
                ranks.setdefault(number, task.host or "?")  # --tasks-per-rank: the task is the rank
        for f in self.failures:
            if f.rank is not None:
                ranks.setdefault(f.rank, f.host or "?")
        return ranks

    def _agents(self) -> bool:
        """Whether torchrun agents run the tasks, rather than one task per rank: as the step's command says, else
        as their lines say (an agent's "failed (exitcode: N) ... (pid: P)")."""
        if self._agents_run is not None:
            return self._agents_run
        return any(f.pid is not None for f in self.failures)

    def _first_failure(self, code: int) -> Failure | None:
        """The rank that failed first, never one ddpkit stopped (exit 3: the watch's report says why)."""
        failed = [f for f in self.failures if f.rank is not None]
        if not failed and not self._agents():  # one task per rank: srun's lines say how each ended, in order
            failed = [Failure(rank=n, host=t.host, exitcode=t.exitcode, seq=t.ended_seq)
                      for n, t in self.tasks.items()
                      if n >= 0 and t.exitcode and (not t.ranks or set(t.ranks) == {n})]
        if not failed and not self.reader.names_failures:
            return self._first_raised(code)
        if not failed or any(f.exitcode == EXIT_MISSING for f in [*failed, *self.failures]):
            return None
        return min(failed, key=lambda f: (failure_order(f.rank or 0, f.exitcode, 0.0)[0], f.timestamp, f.seq,
                                          f.rank or 0))

    def _first_raised(self, code: int) -> Failure | None:
        """The rank whose own traceback (its exception not a peer's failure) began first: MPICH's mpiexec names no
        rank that failed, and a rank's exception is printed as it leaves."""
        own = []
        for number, task in self.tasks.items():
            found = last_traceback(self._rank_stderr(number)) if number >= 0 and task.traceback_seq else None
            if found and found[1] and not any(words in " ".join(found[1]) for words in PEER_GONE):
                own.append((task.traceback_seq, number))
        if not own:
            return None
        _, rank = min(own)
        return Failure(rank=rank, host=self._rank_hosts().get(rank), exitcode=code, raised=True)

    def _task_of(self, rank: int) -> Task | None:
        """The task whose lines carry ``[host:rank]``; with agents, the task of the host the boxes name; with one
        task per rank, the rank's own."""
        found = next((t for t in self.tasks.values() if rank in t.ranks), None)
        failure = next((f for f in self.failures if f.rank == rank and f.host), None)
        if found is None and failure is not None and self._agents():
            found = next((t for t in self.tasks.values() if t.host == failure.host), None)
        return found or (None if self._agents() else self.tasks.get(rank))

    def _rank_stderr(self, rank: int) -> str:
        """What a rank wrote on stderr: its task's lines when the task runs this rank alone, else its own
        ``[host:rank]`` lines; torchrun's own tracebacks taken out."""
        task = self._task_of(rank)
        if task is None:
            return ""
        lines = list(task.stderr)
        if (self._ranks_per_task or len(task.ranks)) > 1:  # its neighbours' lines are in the task's stream too
            lines = [line for line in lines if (p := rank_prefix(line)) is not None and p.rank == rank]
        lines = [line for line in lines
                 if torch_log(line) is None and cxx_log(line) is None and not is_noise(line)]
        return "\n".join(_without_agent_tracebacks(lines))

    def _kernel(self, failure: Failure) -> str | None:
        """The OOM killer's line for a rank killed by SIGKILL on this host (the batch script's: the kernel log of
        another node is not read), where the kernel log can be read."""
        if failure.exitcode != -signal.SIGKILL or failure.host != socket.gethostname().split(".", 1)[0]:
            return None
        return oom_line_for(failure.pid, lived_s=time.monotonic() - self._started + 1)

    def _usage_error(self, rank: int) -> str | None:
        """The ``ddpkit: error:`` line a rank printed (its inputs refused before it started), if any."""
        found = [line for line in self._rank_stderr(rank).splitlines() if line.startswith("ddpkit: error:")]
        return short(found[-1]) if found else None

    def _words(self, rank: int) -> str:
        """What the rank said: its traceback from torch's box where it wrote one, else its stderr lines."""
        failure = next((f for f in self.failures if f.rank == rank and f.traceback), None)
        return failure.traceback if failure else self._rank_stderr(rank)

    def _end(self, rank: int) -> RankEnd:
        failure = next((f for f in self.failures if f.rank == rank), None)
        task = self._task_of(rank)
        code = failure.exitcode if failure else None
        if code is None and task is not None and len(task.ranks) <= 1 and task.exitcode is not None \
                and not self._agents():
            code = task.exitcode
        return RankEnd(rank=rank, exitcode=code, pid=failure.pid if failure else None,
                       kernel=(self._kernel(failure) or "") if failure else "", stderr=self._words(rank))


def _watch_culprit(report: Sequence[str]) -> str | None:
    """The rank the watch found at fault: the first line under the headline of its first report that names a rank
    on a host (the headline names the rank that reported); None where no line under it does."""
    return next((text.strip() for text in report[1:] if _RANK_ON_HOST.search(text)), None)


def _first_report(lines: Sequence[str]) -> list[str]:
    """The first report of the watch: its headline and the indented lines under it, without the stacks."""
    report: list[str] = []
    for text in lines:
        if text.startswith(WATCH):
            if report:
                break
            report.append(text)
        elif report and text.startswith("  ") and not text.startswith("    "):
            report.append(text)
        elif report and text.startswith("---"):
            break
    return [short(text) for text in report][:6]


def _without_agent_tracebacks(lines: list[str]) -> list[str]:
    """The lines without torchrun's own tracebacks (its ChildFailedError, its SignalException when srun ended it,
    a lost rendezvous store: each from its "Traceback" line to its exception, chained parts too) and without its
    "Root Cause" box (between two lines of "=")."""
    kept: list[str] = []
    block: list[str] = []
    in_frames = in_box = False

    def close() -> None:
        if not any(part in line for line in block for part in AGENT_FRAMES):
            kept.extend(block)
        block.clear()

    for line in lines:
        if rank_prefix(line) is not None:  # a ddpkit logger's line, written between the agent's lines by the rank
            kept.append(line)
            continue
        if re.fullmatch(r"={20,}", line.strip()):
            in_box = not in_box
            continue
        if in_box:
            continue
        if line.strip() == TRACEBACK:
            if block and not any(b.startswith(CHAINED) for b in block[-2:]):
                close()  # a new traceback, not the next part of a chained one
            in_frames = True
            block.append(line)
        elif in_frames:
            block.append(line)
            in_frames = line.startswith(" ") or not line.strip()  # until the exception's line
        elif block and (not line.strip() or line.startswith(CHAINED)):
            block.append(line)  # between the parts of a chained traceback
        else:
            close()
            kept.append(line)
    close()
    return kept


def _hosts(ranks: dict[int, str], which: Iterable[int]) -> str:
    hosts = list(dict.fromkeys(ranks[r] for r in which))
    return ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more hosts" if len(hosts) > 3 else "")
