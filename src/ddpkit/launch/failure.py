"""A failed worker group, as values and in one line: torch's typed per-rank failures (its ``ProcessFailure``: pid,
exit code or signal, error file, time) turned into ``RankFailure`` records, the rank that failed first, and the
sentence that names it (torch elastic's ``ChildFailedError`` carries them all).

One reader for every place that reports a failed group: the agent's root-cause line when its restarts are spent,
the digest of an attempt the agent restarts (``ddpkit.launch.ranklogs``), and the attempt's typed result that a
heal supervisor classifies (``ddpkit.launch.result``)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.base.errors import EXIT_MISSING, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.base.log import get_logger
from ddpkit.launcher_output.words import signal_name

__all__ = ["TORCH_WORKER_LOGGER", "RankFailure", "all_preempted", "drop_exit_tracebacks", "failure_order",
           "first_failure", "first_of", "logged_failure", "ordered", "quiet_late_rendezvous_close", "rank_failures",
           "root_cause", "root_cause_line", "signal_name"]

log = get_logger(__name__)

_PREEMPTED = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)
#: The logger of torch's agent whose records name the failed workers (and print their exit tracebacks)
TORCH_WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"
#: torch's line for a failed worker, forked or started afresh (torch/distributed/elastic/multiprocessing/api.py,
#: ``_poll``): its first three arguments are the exit code, the local rank and the pid
_TORCH_FAILED = "failed (exitcode"


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """One failed rank of a worker group, as torch's agent reported it."""

    rank: int
    pid: int
    exit_code: int
    """torch's exit code: negative, the signal that killed the process."""
    timestamp: float = 0.0
    """When it failed (torch's, to the second)."""
    error_file: str | None = None
    """torch's error file for the rank (a Python exception it recorded), where there is one."""

    @property
    def signal(self) -> str | None:
        """``SIGKILL`` where a signal killed it, else None."""
        return signal_name(-self.exit_code) if self.exit_code < 0 else None

    @property
    def stopped_by_ddpkit(self) -> bool:
        """ddpkit ended it (exit 3: the watch's stop, a deadline, a lost peer)."""
        return self.exit_code == EXIT_MISSING

    @property
    def process_exit_code(self) -> int:
        """The exit code a shell shows for it (128 + the signal for a killed one)."""
        return 128 - self.exit_code if self.exit_code < 0 else self.exit_code


def rank_failures(failures: Mapping[int, Any]) -> tuple[RankFailure, ...]:
    """torch's failures (global rank -> ``ProcessFailure``, as ``ChildFailedError.failures`` and the agent's
    ``RunResult`` hold them), typed, the rank that failed first first (``failure_order``)."""
    return ordered(RankFailure(rank=int(rank), pid=int(f.pid), exit_code=int(f.exitcode),
                               timestamp=float(getattr(f, "timestamp", 0) or 0),
                               error_file=getattr(f, "error_file", None) or None) for rank, f in failures.items())


def ordered(failures: Iterable[RankFailure]) -> tuple[RankFailure, ...]:
    """``failures``, the rank that failed first first (``failure_order``)."""
    return tuple(sorted(failures, key=lambda f: failure_order(f.rank, f.exit_code, f.timestamp)))


def logged_failure(record: logging.LogRecord) -> tuple[int, int, int] | None:
    """(local rank, pid, exit code) of the worker torch's record says failed, where it is that record: from the
    exception it carries (forked workers: ``ProcessExitedException``, typed), else from the record's arguments
    (workers started afresh). torch logs it before it ends the others, also before a restart, where no
    ``ChildFailedError`` follows."""
    exc = record.exc_info[1] if record.exc_info else None
    index, pid, code = (getattr(exc, name, None) for name in ("error_index", "error_pid", "exit_code"))
    if isinstance(index, int) and isinstance(pid, int) and isinstance(code, int):
        return index, pid, code
    args = record.args
    if str(record.msg).startswith(_TORCH_FAILED) and isinstance(args, tuple) and len(args) >= 3:
        try:
            code, index, pid = (int(str(a)) for a in args[:3])
        except ValueError:
            return None
        return index, pid, code
    return None


def first_of(failures: Sequence[RankFailure]) -> RankFailure | None:
    """The rank that failed on its own first; None where none did: ddpkit stopped the ranks (exit 3), or they all
    stopped after a preemption."""
    if not failures or any(f.stopped_by_ddpkit for f in failures):
        return None
    first = failures[0]
    return None if all_preempted(failures) else first


def root_cause_line(failures: Sequence[RankFailure]) -> tuple[int, str, int]:
    """(log level, the sentence, the group's exit code) for ``failures`` (in ``rank_failures`` order): the first
    failure names the root cause, with its rank, pid and exit code or signal; its code becomes the group's."""
    if not failures:
        return logging.ERROR, "the workers failed and torch named none of them", 1
    stopped = sorted(f.rank for f in failures if f.stopped_by_ddpkit)
    if stopped:  # ddpkit ended the job (a stalled rank it ended is no failure of its own either)
        return (logging.ERROR, f"rank(s) {', '.join(map(str, stopped))} stopped with exit {EXIT_MISSING}: ddpkit "
                "stopped them (a hang the watch reported, ranks missing, or a deadline expired: the watch's report "
                "names the rank that stopped answering)", EXIT_MISSING)
    first = failures[0]
    if first.signal:
        return logging.ERROR, f"rank {first.rank} (pid {first.pid}) was killed by {first.signal} first", \
            first.process_exit_code
    code = first.exit_code
    if all_preempted(failures):
        if code == EXIT_PREEMPTED:
            return (logging.WARNING, f"the workers stopped after a preemption signal and wrote a snapshot (exit "
                    f"{code}): run the same command again to resume", code)
        return (logging.WARNING, f"the workers stopped after a preemption signal with no snapshot (exit {code}): "
                "their progress is lost; pass --snapshot-path to keep it next time", code)
    others = sorted(f.rank for f in failures if f.rank != first.rank)
    return (logging.ERROR, f"rank {first.rank} (pid {first.pid}) failed first with exit code {code}"
            + (f"; then ranks {others}" if others else ""), code)


def root_cause(exc: object) -> int:
    """Say the root cause of ``exc`` (torch's ``ChildFailedError``) in one line; return the group's exit code."""
    level, line, code = root_cause_line(rank_failures(getattr(exc, "failures", {})))
    log.log(level, "%s", line)
    return code


def first_failure(exc: object) -> int | None:
    """The rank ``root_cause`` names as the one that failed first; None where it names none: ddpkit stopped the
    ranks (exit 3), or they all stopped after a preemption."""
    first = first_of(rank_failures(getattr(exc, "failures", {})))
    return None if first is None else first.rank


def all_preempted(failures: Sequence[RankFailure]) -> bool:
    """Every rank stopped after a preemption signal (the first with 75 or 76, the others so or ended by SIGTERM)."""
    return bool(failures) and failures[0].exit_code in _PREEMPTED \
        and all(f.exit_code in (*_PREEMPTED, -signal.SIGTERM) for f in failures)


def failure_order(rank: int, code: int, timestamp: float) -> tuple[int, float, int]:
    """The sort key that puts the rank that failed first first. Evidence before clocks: a rank ended by SIGTERM was
    stopped by its agent after another failed (torchrun and ddpkit's agent end the survivors so): it never failed
    first while a rank that exited or died on its own is there. Among those, the earlier exit (torch's timestamps
    have one-second resolution: a rank whose failure is a peer's doing waits ``exiting.YIELD_S`` before it leaves,
    so the first to fail exits alone), then the lower rank."""
    return (1 if code == -signal.SIGTERM else 0, timestamp, rank)


def drop_exit_tracebacks(record: logging.LogRecord) -> bool:
    """torch's own lines about a failed worker group, which ``root_cause`` says in one line: the traceback of its
    join() when forked ranks exit non-zero (not the user's problem, and not ddpkit's), and, for ranks started
    afresh, its "failed (exitcode: N) local_rank: R ..." and "Sending process P closing signal SIGTERM" lines."""
    exc = record.exc_info[1] if record.exc_info else None
    if type(exc).__name__ == "ProcessExitedException":
        return False
    text = str(record.msg)
    closing = text.startswith("Sending process") and "closing signal" in text
    return not (text.startswith(_TORCH_FAILED) or closing)


def quiet_late_rendezvous_close(record: logging.LogRecord) -> bool:
    """torch warns "The node ... has failed to shutdown the rendezvous ... RendezvousConnectionError" when, at the
    very end, an agent closes a rendezvous whose store does not answer: the node hosting the store exits as soon as
    every node passed the exit barrier, so a slower node can find it gone (seen in tests/infra/test_multihost_drills).
    The run's outcome is decided by then; it is said at info level, without claiming which of the two happened."""
    text = str(record.msg)
    if "has failed to shutdown the rendezvous" not in text or "RendezvousConnectionError" not in text:
        return True
    log.info("the rendezvous store did not answer when this agent closed the rendezvous after its workers ended "
             "(the node hosting it exits once every node is done, or it was lost); the outcome above stands")
    return False
