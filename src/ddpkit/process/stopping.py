"""Why a run stopped: one state machine, both halves (the agent's and the worker's), and the exit code of each end.

torch elastic's agent keeps a ``WorkerState`` per worker group (INIT, HEALTHY, UNHEALTHY, STOPPED, SUCCEEDED,
FAILED; torch/distributed/elastic/agent/server/api.py). A ddpkit training worker ends in one ``RunOutcome``; the
way there is::

    TRAINING --all steps done------------------------------------------------------------> COMPLETED       (0)
    TRAINING --stop signal on some rank--> STOPPING (all ranks stop after the same step)
        STOPPING --an agent marked a signal from outside (or no ddpkit agent)--> snapshot --> PREEMPTED_SAVED  (75)
                                                                          no snapshot  --> PREEMPTED_UNSAVED (76)
        STOPPING --no mark: the job's own agent is stopping its workers-------------------> STOPPED_BY_AGENT (3*)
    TRAINING --a collective failed or timed out: probe who answers, leave a report-------> PEER_LOST       (3)

    (*) the worker ends by the agent's SIGTERM when it got one, as a process SIGTERM ends; else 3.

The two halves talk through the agent's stop directory (``WorkerContext.stop_dir``, ``DDPKIT_STOP_DIR``):

- agent -> workers: on a signal from outside the job (Slurm, scancel, Ctrl-C) the agent writes ``signal`` (its
  name) *before* torch forwards it; when it stops its workers on its own (torch's agent sends the same SIGTERM after
  a failure elsewhere, before a restart, or when it loses the store) it writes ``stopping.pid-PID`` for each worker
  first. A worker that got a stop signal waits for one of the two (a handshake, not a guess: the signal may reach
  the worker straight from outside, as Slurm signals every process of a step, before the agent's handler ran).
- workers -> agent: a worker that lost its peers leaves ``lost.rank-R`` (first line ``final`` when no restart is
  left, else ``restartable``; then its diagnosis); the agent quotes it, and bounds its own exit on ``final``.
- workers -> agent: a preempted worker writes its exit code (75 or 76) to ``WorkerContext.preempted_mark``, since
  the agent itself only sees that it was signalled.

Under other launchers (torchrun, srun, mpirun) there is no stop directory: every signal counts as from outside.
No torch here, and no import of another ddpkit module but errors.
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
from collections.abc import Iterable
from pathlib import Path

from ddpkit.base.errors import EXIT_MISSING, EXIT_OK, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED

__all__ = ["OUTSIDE_MARK_GRACE_S", "RunOutcome", "final_lost_report", "leave_abort_order", "leave_lost_report",
           "leave_preempted_code", "lost_reports", "mark_outside_signal", "mark_own_stop", "marked_signal",
           "outside_marked", "signal_from_outside", "take_abort_orders"]

#: Seconds at most a worker that got a signal waits for its agent's word (the signal may reach both at once, and a
#: loaded agent may take seconds to run its handler); the agent says it at once when it stops the workers itself, so
#: only an agent that is gone makes a worker wait this long (it is then read as the agent's own stop). Under torch's
#: 30 s shutdown timeout: the worker still has time to snapshot after it.
OUTSIDE_MARK_GRACE_S = 15.0
_SIGNAL = "signal"
_OWN = "stopping.pid-"
_LOST = "lost.rank-"
_ABORT = "abort-order."


class RunOutcome(enum.Enum):
    """How a training run ended on this rank; ``exit_code`` is the one mapping to the process's exit status."""

    COMPLETED = "completed"
    PREEMPTED_SAVED = "preempted-saved"
    PREEMPTED_UNSAVED = "preempted-unsaved"
    STOPPED_BY_AGENT = "stopped-by-agent"
    PEER_LOST = "peer-lost"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]

    @property
    def preempted(self) -> bool:
        return self in (RunOutcome.PREEMPTED_SAVED, RunOutcome.PREEMPTED_UNSAVED)


_EXIT_CODES = {RunOutcome.COMPLETED: EXIT_OK, RunOutcome.PREEMPTED_SAVED: EXIT_PREEMPTED,
               RunOutcome.PREEMPTED_UNSAVED: EXIT_PREEMPTED_UNSAVED, RunOutcome.STOPPED_BY_AGENT: EXIT_MISSING,
               RunOutcome.PEER_LOST: EXIT_MISSING}


# ---- agent -> workers: was the signal from outside the job? ----------------------------------------------------
def signal_from_outside(received: str | None, stop_dir: str | None, grace: float = OUTSIDE_MARK_GRACE_S) -> bool:
    """Did the stop signal this rank ``received`` come from outside the job? With no agent's directory (another
    launcher), yes; else the agent's word: its mark of a signal it received (yes), or of its own stop of this
    process (no), waiting up to ``grace`` s for one; none by then: no (the agent is gone or never said)."""
    if received is None:
        return False
    if not stop_dir:
        return True
    mark, own = Path(stop_dir) / _SIGNAL, Path(stop_dir) / f"{_OWN}{os.getpid()}"
    deadline = time.monotonic() + grace
    while not mark.exists():
        if own.exists() or time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def outside_marked(stop_dir: str | None) -> bool:
    """In the agent: was a signal from outside marked (then its stop of the workers is that signal's)?"""
    return bool(stop_dir) and os.path.exists(os.path.join(stop_dir, _SIGNAL))  # type: ignore[arg-type]


def marked_signal(stop_dir: str | None) -> str | None:
    """In the agent: the name of the signal from outside it marked (``SIGTERM``), or None."""
    if not stop_dir:
        return None
    try:
        return Path(stop_dir, _SIGNAL).read_text().strip() or None
    except OSError:
        return None


def mark_own_stop(stop_dir: str | None, pids: Iterable[int]) -> None:
    """The agent stops the workers ``pids`` on its own (not for a signal from outside): said before it signals them,
    so each knows at once. One file per process (a restarted group's workers are new processes)."""
    if not stop_dir or outside_marked(stop_dir):
        return
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(stop_dir, f"{_OWN}{pid}").touch()


def mark_outside_signal(stop_dir: str | None, name: str) -> None:
    """Leave the agent's mark for a signal from outside (the agent's handler; a drill that sends one itself).
    Raw os calls: the agent writes it from a signal handler."""
    if not stop_dir:
        return
    with contextlib.suppress(OSError):  # the directory is gone: the agent is already leaving
        fd = os.open(os.path.join(stop_dir, _SIGNAL), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, name.encode())
        finally:
            os.close(fd)


# ---- workers -> agent: a lost peer, a preemption's code --------------------------------------------------------
def leave_lost_report(stop_dir: str | None, rank: int, message: str, *, restartable: bool) -> None:
    """A worker that lost its peers leaves its diagnosis for the agent."""
    if not stop_dir:
        return
    with contextlib.suppress(OSError):
        Path(stop_dir, f"{_LOST}{rank}").write_text(f"{'restartable' if restartable else 'final'}\n{message}\n")


def _lost_files(stop_dir: str) -> list[tuple[str, str]]:
    """(first line, diagnosis) of each report, in rank order."""
    found = sorted(Path(stop_dir).glob(f"{_LOST}*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    out = []
    for path in found:
        try:
            first, _, text = path.read_text().partition("\n")
        except OSError:
            continue
        out.append((first, text.strip()))
    return out


def lost_reports(stop_dir: str) -> list[str]:
    """In the agent: the diagnoses the workers left, in rank order."""
    return [text for _, text in _lost_files(stop_dir) if text]


def final_lost_report(stop_dir: str) -> str | None:
    """In the agent: a diagnosis left by a worker with no restart left, if any."""
    return next((text for first, text in _lost_files(stop_dir) if first == "final"), None)


def leave_abort_order(stop_dir: str | None, restart: int, rank: int, order: str) -> None:
    """A worker the watch stops (exit 3) leaves the order that stopped it (``watch.records.AbortOrder`` as JSON: the
    ranks that stopped answering and their hosts) for its agent: a heal supervisor across hosts reads it
    (``ddpkit.heal.elastic``). ``restart``: the worker group's restart count (one file per rank and group)."""
    if not stop_dir:
        return
    with contextlib.suppress(OSError):
        Path(stop_dir, f"{_ABORT}{restart}.{rank}").write_text(order)


def take_abort_orders(stop_dir: str) -> list[str]:
    """In the agent: the abort orders (JSON) its workers left since it last took them, removed as they are read
    (a worker group restarted for a change of membership keeps its restart count)."""
    out = []
    for path in sorted(Path(stop_dir).glob(f"{_ABORT}*")):
        with contextlib.suppress(OSError):
            out.append(path.read_text())
            path.unlink()
    return out


def leave_preempted_code(mark: str | None, outcome: RunOutcome) -> None:
    """A preempted worker tells ddpkit's agent how it ended (the agent only saw that it was signalled)."""
    if mark and outcome.preempted:
        Path(mark).write_text(str(outcome.exit_code))
