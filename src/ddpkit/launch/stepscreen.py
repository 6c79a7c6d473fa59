"""The screen of a job step as ``ddpkit step`` shows it (``ddpkit.launch.steplog``): srun's lines in, with
``--label``'s task (or a rendered torchrun job's lines, one unlabelled stream); out, the lines a user reads (no C++
frames, each C++ warning once, one usage error for all the ranks, tracebacks held once a task prints one or an agent
says a rank failed); and the facts for the digest of a failed step: the ranks and their hosts (``[host:rank]``
lines), torchrun's "failed (exitcode ...)" lines and "Root Cause" boxes, srun's "task T: Exited with exit code N"
lines, the watch's report, Slurm's "CANCELLED" line. Pure apart from the two streams it writes to."""

from __future__ import annotations

import re
import signal
import socket
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ddpkit.base.errors import EXIT_MISSING, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.launch.digest import CHAINED as _CHAINED
from ddpkit.launch.digest import TRACEBACK, WATCH, RankEnd, cause, is_noise, last_traceback, rank_list, said, short
from ddpkit.launch.failure import failure_order
from ddpkit.launch.kernlog import oom_line_for
from ddpkit.process.exiting import PEER_GONE

__all__ = ["RELEASE_S", "Failure", "StepScreen"]

RELEASE_S = 15.0
PREEMPTED = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)
HELD_MAX = 20_000
#: The watch's lines kept for the digest, the first ones (the digest shows its first report; a long job's
#: periodic reports would grow without bound).
WATCH_KEPT = 2_000
TAIL_LINES = 400
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
#: torch's C++ log lines: "[W1126 13:20:16.502588947 socket.cpp:207] ...", on a rank "[rank1]:[W1126 ...] ..."
_CXX = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} [\d:.]+ [^\]]+\]\s*(.*)$")
#: torch's Python loggers as torchrun configures them: "E1126 13:20:37.738000 2658 torch/.../api.py:1002] ..."
_TORCH_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S+\] (.*)$")
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SRUN_EXIT = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|(.+))$")
#: how srun says a task died of a signal (its words are strsignal's)
_SRUN_SIGNALS = {"Killed": signal.SIGKILL, "Aborted": signal.SIGABRT, "Segmentation fault": signal.SIGSEGV,
                 "Terminated": signal.SIGTERM, "Bus error": signal.SIGBUS}
#: slurmstepd's "*** STEP 7.0 ON node1 CANCELLED AT 2026-11-26T13:33:40 DUE TO JOB REQUEUE ***" (or JOB ...)
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO [^*]+)? \*\*\*")
#: Open MPI's --tag-output: "[1,3]<stderr>:text", the job's number and the rank
_OMPI_TAG = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?(.*)$")
#: Open MPI's box on the first process with a non-zero exit code, and its line on a process a signal ended
_MPI_FIRST = re.compile(r"^\s*Process name: \[\[\d+,\d+\],(\d+)\]")
_MPI_EXIT = re.compile(r"^\s*Exit code:\s+(-?\d+)")
_MPI_SIGNAL = re.compile(r"mpirun noticed that process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_MPI_FAILED = ("Primary job  terminated normally", "mpirun detected that one or more processes")
#: MPICH's -prepend-rank: "[3] text"; its exit says no rank, so the rank whose own traceback came first is named
_MPICH_TAG = re.compile(r"^\[(\d+)\] ?(.*)$")
_PREFIX = re.compile(r"^\[([^\]:\s]+):(\d+)\] ")
_RANK_ON_HOST = re.compile(r"\brank (\d+) on (?:host )?([\w.\-]+)")
_BOX_FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")
_NUMBERS = re.compile(r"0x[0-9a-f]+|\d+")
#: the frames that say a traceback is torchrun's own (its agent), not a rank's
_AGENT_FRAMES = ("torch/distributed/elastic/", "/bin/torchrun", "torch/distributed/run.py",
                 "torch/distributed/launcher/")


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
class _Task:
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ranks: dict[int, str] = field(default_factory=dict)  # rank -> host, from its [host:rank] lines
    ended_seq: int = 0
    host: str | None = None
    exitcode: int | None = None
    quiet_block: bool = False
    box: dict[str, str] | None = None
    box_traceback: list[str] | None = None
    traceback_seq: int = 0
    """When its first Python traceback began (``StepScreen._seq``; 0: none)."""


class StepScreen:
    """The job's screen for one step: lines in (``take``), what the user reads out (``out``/``err``), and the facts
    a digest needs. Pure apart from the streams it writes to."""

    def __init__(self, out: TextIO, err: TextIO, *, agents: bool | None = None, ranks_per_task: int | None = None,
                 release_s: float = RELEASE_S, launcher: str = "srun", show_all: bool = False) -> None:
        """``agents``: whether each task is a torchrun agent (True) or a rank (False); None: from their lines.
        ``ranks_per_task``: torchrun's --nproc-per-node (None: from the ranks' lines). ``launcher``: the program
        whose lines come in: ``srun`` (labelled by ``--label``, one task per line's label) or another (a rendered
        torchrun job: one unlabelled stream, the agent's). ``show_all``: every line shown as it came (where the
        output is the only full log, a Kubernetes pod's): the screen only reads them, for the digest."""
        self._out, self._err = out, err
        self._launcher = launcher
        self._show_all = show_all
        self._agents_run = agents
        self._ranks_per_task = ranks_per_task
        self.cancelled: str | None = None
        """Slurm's line where it cancelled the step or the job (scancel, a requeue, the time limit)."""
        self._release_s = release_s
        self.tasks: dict[int, _Task] = {}
        self.failures: list[Failure] = []
        self.watch: list[tuple[int, str]] = []
        self._watching: set[int] = set()
        self._failing = False
        self._pending: float | None = None
        self._held: deque[str] = deque(maxlen=HELD_MAX)
        self._kinds: set[str] = set()
        self._errors: set[str] = set()
        self._started = time.monotonic()
        self._seq = 0
        self._mpi_first: int | None = None

    # -- lines in --------------------------------------------------------------------------------------------
    def take(self, line: str, *, to_stderr: bool, now: float | None = None) -> None:
        """One whole line srun wrote (labelled ``T: ...`` with ``--label``; unlabelled lines are srun's own)."""
        self._seq += 1
        label = {"srun": _LABEL, "mpirun": _OMPI_TAG, "mpich": _MPICH_TAG}.get(self._launcher)
        found = label.match(line) if label is not None else None
        number, text = (int(found[1]), found[2]) if found else (-1, line)
        task = self.tasks.setdefault(number, _Task())
        if number >= 0 and not task.traceback_seq and text.strip() == TRACEBACK:
            task.traceback_seq = self._seq
        self._learn(number, task, text, to_stderr)
        if self._show_all:
            if to_stderr:
                task.stderr.append(text)
            self._show(self._err if to_stderr else self._out, line)
            return
        if is_noise(text) or text.strip() == "<omitting python frames>":
            return
        if number < 0 and self._launcher == "mpirun" and re.fullmatch(r"-{20,}", text.strip()):
            return  # the frame of mpirun's boxes (their words are shown, or held once a rank failed)
        if not to_stderr:
            self._show(self._out, text)
            return
        task.stderr.append(text)
        cxx = _CXX.match(text)
        if cxx:
            kind = _NUMBERS.sub("N", re.sub(r"\(.*\)|\[[^\]]*\]", "", cxx[1]))
            if not self._failing and kind not in self._kinds:
                self._kinds.add(kind)
                self._show(self._err, text)
            return
        if self._duplicate_error(task, text):
            return
        if not self._failing and self._pending is None and text.strip() == TRACEBACK:
            self._pending = time.monotonic() if now is None else now
        if self._failing or self._pending is not None:
            self._held.append(text)
        else:
            self._show(self._err, text)

    def tick(self, now: float | None = None) -> None:
        """Show what was held when no failure followed a traceback within ``release_s`` (a handled one)."""
        now = time.monotonic() if now is None else now
        if not self._failing and self._pending is not None and now - self._pending > self._release_s:
            self.release()

    def release(self) -> None:
        for text in self._held:
            self._show(self._err, text)
        self._held.clear()
        self._pending = None

    @property
    def failing(self) -> bool:
        return self._failing

    def _learn(self, number: int, task: _Task, text: str, to_stderr: bool) -> None:
        """The facts in a line: who runs in the task, the watch's report, an agent's or srun's failure lines."""
        prefix = _PREFIX.match(text)
        if prefix:
            task.ranks[int(prefix[2])] = prefix[1]
            task.host = task.host or prefix[1]
        if text.startswith(WATCH):
            self._watching.add(number)
        elif not text.startswith((" ", "---")):  # a report's lines end
            self._watching.discard(number)
        if number in self._watching and len(self.watch) < WATCH_KEPT:
            self.watch.append((number, text))
        torch_line = _TORCH_LOG.match(text)
        if torch_line:
            failed = _FAILED.search(torch_line[1])
            if failed:
                self._failing = True
                if not any(f.pid == int(failed[3]) for f in self.failures):
                    self.failures.append(Failure(rank=None, host=task.host, exitcode=int(failed[1]),
                                                 pid=int(failed[3]), seq=self._seq))
        if number < 0 and self._launcher == "mpirun":
            self._learn_mpirun(text)
        srun = _SRUN_EXIT.match(text) if number < 0 else None
        if srun:
            self._failing = True
            for t in _numbers(srun[2]):
                other = self.tasks.setdefault(t, _Task())
                other.host = srun[1]
                sig = _SRUN_SIGNALS.get((srun[4] or "").strip())
                other.exitcode = int(srun[3]) if srun[3] else -int(sig) if sig else None
                other.ended_seq = self._seq
        if "ChildFailedError" in text:
            self._failing = True
        cancelled = _CANCELLED.search(text)
        if cancelled and self.cancelled is None:
            self.cancelled = cancelled[0].strip("* ")
        self._read_box(task, text)

    def _learn_mpirun(self, text: str) -> None:
        """Open MPI's own lines: the first process with a non-zero exit code ("Process name: [[J,1],R]" then "Exit
        code: N"), a process a signal ended ("mpirun noticed that process rank R ... on node H exited on signal S")."""
        if any(words in text for words in _MPI_FAILED):
            self._failing = True
        first = _MPI_FIRST.match(text)
        if first:
            self._mpi_first = int(first[1])
            return
        code = _MPI_EXIT.match(text)
        if code and self._mpi_first is not None:
            task = self.tasks.setdefault(self._mpi_first, _Task())
            task.exitcode, task.ended_seq, self._mpi_first, self._failing = int(code[1]), self._seq, None, True
            return
        killed = _MPI_SIGNAL.search(text)
        if killed:
            task = self.tasks.setdefault(int(killed[1]), _Task())
            task.host, task.exitcode, task.ended_seq = killed[2], -int(killed[3]), self._seq
            self._failing = True

    def _read_box(self, task: _Task, text: str) -> None:
        """torchrun's "Root Cause" box: one entry per failed rank (time, host, global rank, exit code and pid, and
        the rank's traceback where it wrote torch's error file), each opened by "[N]:"."""
        stripped = text.strip()
        if re.fullmatch(r"\[\d+\]:", stripped):
            self._box_done(task)
            task.box, task.box_traceback = {}, None
            return
        if task.box is None:
            return
        if task.box_traceback is not None:  # the traceback field's lines, indented by the box
            if stripped and text.startswith("  ") and not re.fullmatch(r"[=\-]{20,}", stripped):
                task.box_traceback.append(text[2:])
            else:
                self._box_done(task)
            return
        found = _BOX_FIELD.match(text)
        if not found:
            self._box_done(task)
        elif found[1] == "traceback" and found[2].strip() == TRACEBACK:
            task.box_traceback = [TRACEBACK]
        elif found[1] == "traceback":
            self._box_done(task)
        else:
            task.box[found[1]] = found[2].strip()

    def _box_done(self, task: _Task) -> None:
        if task.box is None:
            return
        box, task.box = task.box, None
        traceback, task.box_traceback = "\n".join(task.box_traceback or []), None
        rank = re.match(r"(\d+)", box.get("rank", ""))
        code = re.match(r"(-?\d+)(?: \(pid: (\d+)\))?", box.get("exitcode", ""))
        if not (rank and code):
            return
        pid = int(code[2]) if code[2] else None
        failure = next((f for f in self.failures if pid is not None and f.pid == pid), None)
        if failure is None:
            failure = Failure(rank=None, host=None, exitcode=int(code[1]), pid=pid, seq=self._seq)
            self.failures.append(failure)
        host = box.get("host")
        if host == "localhost" and self._launcher != "srun":  # a standalone torchrun's box: the agent is here
            host = socket.gethostname().split(".", 1)[0]
        failure.rank, failure.host, failure.timestamp = int(rank[1]), host, box.get("time", "")
        failure.traceback = traceback or failure.traceback

    def _duplicate_error(self, task: _Task, text: str) -> bool:
        """A ``ddpkit: error:`` block (its first line and the indented lines under it) another task already
        printed: every rank that checks the same input says the same."""
        if text.startswith("ddpkit: error:"):
            task.quiet_block = text in self._errors
            self._errors.add(text)
            return task.quiet_block
        if task.quiet_block and text.startswith(" "):
            return True
        task.quiet_block = False
        return False

    def _show(self, stream: TextIO, text: str) -> None:
        stream.write(text + "\n")
        stream.flush()

    # -- the digest ------------------------------------------------------------------------------------------
    def digest(self, code: int, log: str) -> list[str]:
        """The failed step on one screen, cause first: the rank that failed first on its own, with its host and
        words; where ddpkit stopped the ranks (exit 3) or no rank failed on its own, what the watch found first.
        A step Slurm cancelled where no rank failed on its own (a requeue, scancel) is said in one line."""
        for task in self.tasks.values():  # a box the step's end cut short
            self._box_done(task)
        ranks = self._rank_hosts()
        first = self._first_failure(code)
        own = first is not None and first.exitcode not in (-signal.SIGTERM, *PREEMPTED)
        if self.cancelled and not own and not self.watch:
            return [f"ddpkit: Slurm ended the step (srun exit code {code}): {self.cancelled}; its full output: {log}"]
        report = _first_report([text for _, text in self.watch])
        what = "job step" if self._launcher == "srun" else "job"
        program = "mpiexec" if self._launcher == "mpich" else self._launcher
        head = f"ddpkit: the {what} failed ({program} exit code {code})"
        lines: list[str] = []
        culprit = None
        if first is not None and first.rank is not None:
            where = f" on host {first.host}" if first.host else ""
            how = (f"was killed by {_signal_name(first.exitcode)}" if first.exitcode < 0
                   else "raised first" if first.raised else f"failed first with exit code {first.exitcode}")
            error = self._usage_error(first.rank)
            if error:  # shown once above, as every rank printed it
                lines.append(f"{head}: rank {first.rank}{where} {how}: {error}")
            else:
                lines.append(f"{head}: rank {first.rank}{where} {how}")
                kernel = self._kernel(first)
                lines += [f"    {line}" for line in ([f"the kernel: {kernel}"] if kernel else [])
                          + self._cause(first.rank)]
        elif report:
            culprit = self._watch_culprit(report)
            lines.append(f"{head}; the watch found first: {culprit or report[0].removeprefix(WATCH).strip()}")
        elif self._errors:
            lines.append(f"{head}: {sorted(self._errors)[0]}")
        else:  # no rank known to have failed: the step's own last words (its last traceback, else its last lines)
            lines.append(head)
            said_last = "\n".join(line for task in self.tasks.values() for line in task.stderr)
            lines += [f"    {line}" for line in cause(RankEnd(rank=-1, stderr=said_last))] if said_last else []
        shown_first = first.rank if first is not None else None
        named = _RANK_ON_HOST.search(culprit or "")
        groups: dict[str, list[int]] = {}
        for rank in sorted(ranks):
            if rank == shown_first:
                continue
            words = said(self._end(rank), shown_first)
            if not self._agents():  # one task per rank: srun (--kill-on-bad-exit) or mpirun ends the others
                words = words.replace("by the agent", f"by {self._launcher}")
            error = self._usage_error(rank)
            if error and error not in words:
                words = f"{words}: {error}"
            if named and rank == int(named[1]):  # its words after the report are about the job's end, not why
                words = "the rank the watch named (what it said as the step ended: in the full output)"
            groups.setdefault(words, []).append(rank)
        lines += [f"  {rank_list(r)} ({_hosts(ranks, r)}): {words}" for words, r in groups.items()]
        lines += [f"  {text}" for text in report if text.strip() != culprit]
        whose = "this node and its ranks" if self._launcher == "torchrun" else "every node and rank"
        lines.append(f"  full output of {whose}: {log}")
        return lines

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
        if not failed and self._launcher == "mpich":
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

    @staticmethod
    def _watch_culprit(report: Sequence[str]) -> str | None:
        """The rank the watch found at fault: the first line under the headline of its first report that names a
        rank on a host (the headline names the rank that reported); None where no line under it does."""
        return next((text.strip() for text in report[1:] if _RANK_ON_HOST.search(text)), None)

    def _task_of(self, rank: int) -> _Task | None:
        """The task whose lines carry ``[host:rank]``; with agents, the task of the host the boxes name."""
        found = next((t for t in self.tasks.values() if rank in t.ranks), None)
        failure = next((f for f in self.failures if f.rank == rank and f.host), None)
        if found is None and failure is not None and self._agents():
            found = next((t for t in self.tasks.values() if t.host == failure.host), None)
        return found

    def _rank_stderr(self, rank: int) -> str:
        """What a rank wrote on stderr: its task's lines when the task runs this rank alone, else its own
        ``[host:rank]`` lines; torchrun's own tracebacks taken out."""
        task = self._task_of(rank) or (None if self._agents() else self.tasks.get(rank))  # a task is a rank
        if task is None:
            return ""
        lines = list(task.stderr)
        if (self._ranks_per_task or len(task.ranks)) > 1:  # its neighbours' lines are in the task's stream too
            lines = [line for line in lines if (m := _PREFIX.match(line)) and int(m[2]) == rank]
        lines = [line for line in lines if not (_TORCH_LOG.match(line) or _CXX.match(line) or is_noise(line))]
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

    def _cause(self, rank: int) -> list[str]:
        return cause(RankEnd(rank=rank, stderr=self._words(rank)))

    def _end(self, rank: int) -> RankEnd:
        failure = next((f for f in self.failures if f.rank == rank), None)
        task = self._task_of(rank) or (None if self._agents() else self.tasks.get(rank))  # a task is a rank
        code = failure.exitcode if failure else None
        if code is None and task is not None and len(task.ranks) <= 1 and task.exitcode is not None \
                and not self._agents():
            code = task.exitcode
        return RankEnd(rank=rank, exitcode=code, pid=failure.pid if failure else None,
                       kernel=(self._kernel(failure) or "") if failure else "", stderr=self._words(rank))


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
        if not any(part in line for line in block for part in _AGENT_FRAMES):
            kept.extend(block)
        block.clear()

    for line in lines:
        if _PREFIX.match(line):  # a ddpkit logger's line, written between the agent's lines by the rank
            kept.append(line)
            continue
        if re.fullmatch(r"={20,}", line.strip()):
            in_box = not in_box
            continue
        if in_box:
            continue
        if line.strip() == TRACEBACK:
            if block and not any(b.startswith(_CHAINED) for b in block[-2:]):
                close()  # a new traceback, not the next part of a chained one
            in_frames = True
            block.append(line)
        elif in_frames:
            block.append(line)
            in_frames = line.startswith(" ") or not line.strip()  # until the exception's line
        elif block and (not line.strip() or line.startswith(_CHAINED)):
            block.append(line)  # between the parts of a chained traceback
        else:
            close()
            kept.append(line)
    close()
    return kept


def _numbers(text: str) -> Iterable[int]:
    for part in text.split(","):
        a, _, b = part.partition("-")
        if a.isdigit():
            yield from range(int(a), int(b or a) + 1)


def _hosts(ranks: dict[int, str], which: Iterable[int]) -> str:
    hosts = list(dict.fromkeys(ranks[r] for r in which))
    return ", ".join(hosts[:3]) + (f" and {len(hosts) - 3} more hosts" if len(hosts) > 3 else "")


def _signal_name(code: int) -> str:
    return signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
