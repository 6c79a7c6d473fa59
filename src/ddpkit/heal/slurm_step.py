"""One ``srun`` step of a heal supervisor inside its Slurm allocation: started on named nodes, its output echoed into
the job's log as it comes and read for evidence, ended within a bound once a rank failed.

The step: ``srun --nodelist=A,B --nodes=2 --ntasks-per-node=P --kill-on-bad-exit=1 --overlap --label PROGRAM``: one
task per rank (ddpkit's Slurm detection reads rank, world and the first node of the step as the master from Slurm's
variables; the supervisor gives each step its own ``MASTER_PORT``), the first task that fails ends the step
(``--kill-on-bad-exit``), a step left hanging on a host that was cut off does not block the next one
(``--overlap``), every line says its rank (``--label``).

The evidence, read from that output (``classify``'s records; nothing is parsed back out of a ddpkit headline that
has a typed form elsewhere):

- srun's own lines: ``srun: error: node2: task 1: Killed`` (a signal), ``... Exited with exit code 3``; the first
  one is the rank that failed first; those after srun said it is terminating the step are srun's doing;
- the watch's ``rank R on host H (pid P) stopped answering`` (a rank whose heartbeat stopped: the heal rule names
  it within seconds, ``WatchOptions.silent_stop``);
- each rank's last Python traceback (its labelled lines).

srun's reader (``ddpkit.launcher_output.srun``) turns the lines into those events, as it does for ``ddpkit step``'s
digest.

Once srun says a task failed, it gets ``teardown_s`` to end the step (``FAULT_BOUND_S`` after any other first word
of a fault); then it is interrupted (SIGINT twice, srun's way of
ending a step) and at last killed: a host cut off from the network never answers srun, which would wait for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ddpkit.heal.classify import Evidence, RankEvidence
from ddpkit.heal.evidence import rank_ended, tracebacks_of, watch_of, with_exceptions
from ddpkit.launcher_output import SilentRank, TasksEnded
from ddpkit.launcher_output.srun import SrunReader
from ddpkit.launcher_output.words import signal_number

__all__ = ["StepPlan", "StepRun", "run_step", "srun_argv"]

#: ddpkit's own stop (the watch's abort): never a rank failing on its own.
_STOPPED_CODES = (3,)
#: How a task srun ended (after it said it is ending the step) ends: srun's signals, or a preemption's exits.
_SRUN_SIGNALS = (signal.SIGTERM, signal.SIGKILL)
_PREEMPTED_CODES = (75, 76)
TAIL_LINES = 400
#: The longest a step may run on after the first line that named a fault (the ranks' own abort, report and exit
#: take a few seconds; ``teardown_s`` counts from srun's word that a task ended instead).
FAULT_BOUND_S = 30.0


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """What one step runs, where."""

    nodes: tuple[str, ...]
    per_node: int
    program: tuple[str, ...]
    """Each task's command line (``PYTHON -m ddpkit train ...``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the supervisor's environment for the step (srun exports it to every task)."""
    name: str = "attempt"


def srun_argv(plan: StepPlan) -> list[str]:
    return ["srun", f"--nodelist={','.join(plan.nodes)}", f"--nodes={len(plan.nodes)}",
            f"--ntasks={len(plan.nodes) * plan.per_node}", f"--ntasks-per-node={plan.per_node}",
            "--kill-on-bad-exit=1", "--overlap", "--label", f"--job-name={plan.name}", *plan.program]


@dataclass(kw_only=True)
class StepRun:
    """How a step went."""

    exit_code: int
    """The first failed task's code (128 + signal for a signal), else srun's own; 0 when every task succeeded."""
    began: float
    ended: float
    fault_at: float | None = None
    """When the first line saying a rank failed or stopped answering arrived (wall clock)."""
    fault_line: str | None = None
    evidence: Evidence | None = None
    tracebacks: dict[int, str] = field(default_factory=dict)
    """Each rank's last traceback, as it printed it."""


class _Reader:
    """Reads the step's merged output on a thread: echoes every line, keeps what the evidence needs."""

    def __init__(self, stream: object, echo: Callable[[str], None], hosts_of: Callable[[int], str]) -> None:
        self.stream = stream
        self.echo = echo
        self.hosts_of = hosts_of
        self.srun = SrunReader()
        self.tails: dict[int, deque[str]] = {}
        self.failed: list[RankEvidence] = []
        self.silent: list[SilentRank] = []
        self.stopped: dict[int, str] = {}
        self.fault_at: float | None = None
        self.fault_line: str | None = None
        self.task_failed_at: float | None = None
        """When srun first said a task ended badly (the step has failed; srun is ending the rest)."""
        self.thread = threading.Thread(target=self._loop, name="ddpkit-heal-step", daemon=True)
        self.thread.start()

    def _fault(self, line: str) -> None:
        if self.fault_at is None:
            self.fault_at, self.fault_line = time.time(), line

    def _loop(self) -> None:
        for raw in iter(self.stream.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode(errors="replace").rstrip("\n")
            self.echo(line)
            self._read(line)

    def _read(self, line: str) -> None:
        reading = self.srun.read(line)
        if reading.source is not None:
            self.tails.setdefault(reading.source, deque(maxlen=TAIL_LINES)).append(reading.text)
        for event in reading.events:
            if isinstance(event, SilentRank):
                self.stopped[event.rank] = event.host
                self.silent.append(event)
                self._fault(event.line)
            elif isinstance(event, TasksEnded):
                for rank in event.tasks:
                    by_srun = event.after_step_ending and (event.signal in _SRUN_SIGNALS
                                                           or event.exit_code in _PREEMPTED_CODES)
                    self.task_failed_at = self.task_failed_at or time.time()
                    self.failed.append(rank_ended(rank, event.host, event, first=not self.failed,
                                                  stopped_by_ddpkit=by_srun or event.exit_code in _STOPPED_CODES))
                self._fault(line)

    def only_silent_left(self, plan: StepPlan) -> bool:
        """The watch named silent hosts and every task on the other hosts has ended (srun said so): what is left of
        the step is on hosts that do not answer."""
        if not self.stopped or self.task_failed_at is None:
            return False
        silent = set(self.stopped.values())
        ended = {f.rank for f in self.failed}
        tasks = range(len(plan.nodes) * plan.per_node)
        return all(r in ended for r in tasks if plan.nodes[r // plan.per_node] not in silent)

    def evidence(self, exit_code: int, outside: str | None) -> tuple[Evidence, dict[int, str]]:
        ranks: dict[int, RankEvidence] = {}
        for found in self.failed:
            ranks.setdefault(found.rank, found)  # a task's first word on it counts
        tracebacks = tracebacks_of(self.tails, self.hosts_of)
        with_exceptions(ranks, tracebacks)
        watch = watch_of(self.silent) if self.silent else None
        return Evidence(exit_code=exit_code, ranks=tuple(ranks.values()), watch=watch,
                        outside_signal=outside), {t.rank: t.text for t in tracebacks}


def run_step(plan: StepPlan, *, teardown_s: float, deadline_s: float | None = None,
             outside: Callable[[], str | None] = lambda: None,
             echo: Callable[[str], None] | None = None) -> StepRun:
    """Run the step to its end (bounded: ``teardown_s`` after the first fault, ``deadline_s`` in all when given);
    ``outside()`` names a signal the supervisor received from outside (the scheduler's), else None."""
    say = echo or (lambda line: print(line, flush=True))
    env = {**os.environ, **plan.env}
    began = time.time()
    proc = subprocess.Popen(srun_argv(plan), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    reader = _Reader(proc.stdout, say, lambda rank: plan.nodes[min(rank // plan.per_node, len(plan.nodes) - 1)])
    stage = 0  # 0: running; 1: interrupted (SIGINT twice); 2: killed
    stage_at = 0.0
    while proc.poll() is None:
        time.sleep(0.1)
        now = time.time()
        if stage < 2 and reader.only_silent_left(plan) and now >= (reader.task_failed_at or now) + 1.0:
            say(f"ddpkit heal: every task of the {plan.name} step on a host that answers has ended; srun waits for "
                f"{', '.join(sorted(set(reader.stopped.values())))}, which stopped answering: ending srun")
            with_signal(proc, signal.SIGKILL)
            stage = 2
            continue
        if reader.task_failed_at is not None and now >= reader.task_failed_at + teardown_s:
            why = f"{now - reader.task_failed_at:.0f} s after a task failed"
        elif reader.fault_at is not None and now >= reader.fault_at + FAULT_BOUND_S:
            why = f"{now - reader.fault_at:.0f} s after the fault"
        elif deadline_s is not None and now >= began + deadline_s:
            why = f"at its deadline of {deadline_s:g} s"
        else:
            continue
        if stage == 0:
            say(f"ddpkit heal: srun has not ended the {plan.name} step {why}: interrupting it")
            with_signal(proc, signal.SIGINT)
            time.sleep(0.3)
            with_signal(proc, signal.SIGINT)
            stage, stage_at = 1, now
        elif stage == 1 and now > stage_at + 5:
            with_signal(proc, signal.SIGKILL)
            stage = 2
    code = proc.wait()
    reader.thread.join(timeout=5)
    ended = time.time()
    first = next((r for r in reader.failed if r.first), None)
    if first is not None and (first.exit_code or first.signal):
        code = first.exit_code if first.exit_code is not None else 128 + (signal_number(first.signal) or 9)
    elif code < 0:
        code = 128 - code
    evidence, tracebacks = reader.evidence(code, outside())
    return StepRun(exit_code=code, began=began, ended=ended, fault_at=reader.fault_at, fault_line=reader.fault_line,
                   evidence=evidence, tracebacks=tracebacks)


def with_signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        return

