"""A failed worker group, said in one line: the first rank to fail, its pid and exit code (torch elastic's
ChildFailedError carries them all)."""

from __future__ import annotations

import logging
import signal
from typing import Any

from ddpkit.base.errors import EXIT_MISSING, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.base.log import get_logger

__all__ = ["drop_exit_tracebacks", "failure_order", "first_failure", "quiet_late_rendezvous_close", "root_cause"]

log = get_logger(__name__)


def root_cause(exc: object) -> int:
    """The first failure (by time) names the root cause: rank, pid and exit code; its code becomes ours."""
    failures = getattr(exc, "failures", {})
    if not failures:
        return 1
    stopped = sorted(r for r, f in failures.items() if f.exitcode == EXIT_MISSING)
    if stopped:  # ddpkit ended the job (a stalled rank it ended is no failure of its own either)
        log.error("rank(s) %s stopped with exit %d: ddpkit stopped them (a hang the watch reported, ranks missing, or "
                  "a deadline expired: the watch's report names the rank that stopped answering)",
                  ", ".join(map(str, stopped)), EXIT_MISSING)
        return EXIT_MISSING
    rank, first = _first(failures)
    code = int(first.exitcode)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        log.error("rank %d (pid %d) was killed by %s first", rank, first.pid, name)
        return 128 - code
    if _all_preempted(failures, code):
        if code == EXIT_PREEMPTED:
            log.warning("the workers stopped after a preemption signal and wrote a snapshot (exit %d): run the "
                        "same command again to resume", code)
        else:
            log.warning("the workers stopped after a preemption signal with no snapshot (exit %d): their progress "
                        "is lost; pass --snapshot-path to keep it next time", code)
        return code
    others = sorted(r for r in failures if r != rank)
    log.error("rank %d (pid %d) failed first with exit code %d%s", rank, first.pid, code,
              f"; then ranks {others}" if others else "")
    return code


def first_failure(exc: object) -> int | None:
    """The rank ``root_cause`` names as the one that failed first; None where it names none: ddpkit stopped the
    ranks (exit 3), or they all stopped after a preemption."""
    failures = getattr(exc, "failures", {})
    if not failures or any(f.exitcode == EXIT_MISSING for f in failures.values()):
        return None
    rank, first = _first(failures)
    return None if _all_preempted(failures, int(first.exitcode)) else rank


def _first(failures: dict[int, Any]) -> tuple[int, Any]:
    return min(failures.items(), key=lambda kv: failure_order(kv[0], int(kv[1].exitcode), kv[1].timestamp))


def _all_preempted(failures: dict[int, Any], code: int) -> bool:
    """Every rank stopped after a preemption signal (the first with 75 or 76, the others so or ended by SIGTERM)."""
    preempted = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)
    return code in preempted and all(f.exitcode in (*preempted, -signal.SIGTERM) for f in failures.values())


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
    return not (text.startswith("failed (exitcode") or closing)


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
