"""When a collective fails on a rank, or the launcher ends a rank while a peer on its host is gone: one report per
job that names the ranks that are gone or stopped, with their hosts, before the launcher ends the rest.

gloo's own error names an address ("Connection reset by peer [addr]"), no rank; torchrun ends every rank 0.1 s after
one dies, often before their collectives with it fail (``watch/sigterm.py`` calls ``on_terminate`` then). Store keys
(under the watch's prefix): ``failed`` (the reporting rank, first writer wins), ``term/<rank>`` (a rank told to stop:
a peer ended by the same SIGTERM is no news). Under ddpkit's agent a file in its stop directory,
``watch-report.<restart>``, says a rank on this host reported: the store goes with rank 0, which holds it there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit.base.log import get_logger
from ddpkit.process.worker_context import WorkerContext
from ddpkit.watch.processes import ended_by_watch, process_state
from ddpkit.watch.records import Heartbeat

if TYPE_CHECKING:
    from ddpkit.watch.recorder import Recorder

__all__ = ["FailureReport"]

log = get_logger(__name__)
#: How long the report waits for a peer on this host whose connection broke to be gone (it is exiting).
GONE_WAIT_S = 0.3


class WatchView(Protocol):
    """What the failure report reads of its rank's watch (``watch.monitor.Monitor`` has it): a narrow view, so that
    the report and the monitor, which owns it, do not import each other."""

    rank: int
    rec: Recorder
    store: Any
    """The job's store, every call bounded (``watch.store.BoundedStore``)."""
    seen: dict[int, tuple[Any, float]]
    """rank -> (heartbeat, when it last changed, on this rank's clock)."""
    last_read: dict[int, Heartbeat | None]
    """The records of the last read the store answered."""

    @property
    def aborting(self) -> bool: ...
    def read(self) -> dict[int, Heartbeat | None]: ...
    def emit(self, lines: list[str], event: dict[str, Any]) -> None: ...


class FailureReport:
    """The failure report of one rank's watch (``Monitor.failures``)."""

    def __init__(self, monitor: WatchView) -> None:
        self.monitor = monitor
        self._lock = threading.Lock()
        self._reported = False
        self._done = threading.Event()
        self._thread: int | None = None  # the thread writing the report, while it does
        self.after_report: Callable[[], object] | None = None
        """Run once the report under way is written (``watch/sigterm.py``: SIGTERM came in the middle)."""

    def now(self, told_to_stop: bool = False) -> None:
        """Called on the thread that saw the failure, before the error reaches the user's code; or on SIGTERM
        (``told_to_stop``, from ``on_terminate``) when a rank on this host is gone and no collective failed here."""
        with self._lock:
            if self._reported or (self.monitor.rec.failed is None and not told_to_stop) or self.monitor.aborting:
                return
            self._reported = True
            self._thread = threading.get_ident()
        try:
            self._write(self.monitor.rec.failed)
        except Exception as exc:  # the store may be gone too: the backend's own error still follows
            log.debug("watch: no failure report (%s)", exc)
        finally:
            self._thread = None
            self._done.set()
            then = self.after_report
            if then is not None:
                then()

    def writing_here(self) -> bool:
        """This thread is writing the failure report (a signal handler that interrupted it must not wait for it)."""
        return self._thread == threading.get_ident()

    def on_terminate(self) -> None:
        """This rank is told to stop (SIGTERM; ``watch/sigterm.py``). A launcher ends every rank when one dies (torchrun
        within 0.1 s), often before their collective with it failed, or before that failure reached the report: say
        now what is known, once per job. A collective failed here: its report. Else a rank on this host that is gone
        or stopped, and was not told to stop too (a rank told to stop marks ``term/<rank>`` first, so a peer ended by
        the same SIGTERM is never named): the report names it. Else nothing (a scheduler ending a healthy job).
        Quick, but the caller bounds it (a store that does not answer)."""
        m = self.monitor
        if m.aborting:
            return  # the abort is ending this rank anyway: its report is written
        with contextlib.suppress(Exception):
            m.store.set(f"term/{m.rank}", "1")
        marked = _told_mark(m.rank)  # also on this host's disk: a store held by a rank told to stop dies with it
        if marked is not None:
            with contextlib.suppress(OSError):
                open(marked, "w").close()
        if self._reported:  # a report under way on another thread of this rank
            self._done.wait()
            return
        if m.rec.failed is not None:
            self.now()
            return
        records = m.read()
        local = self._peers_here(records)
        # a peer that finished is no news (it left as a rank should); one that ddpkit's watch stopped is
        if any(process_state(pid) in ("gone", "stopped") and not self._told(r) and not _finished(records[r])
               for r, pid in local.items()):
            self.now(told_to_stop=True)

    def _told(self, rank: int) -> bool:
        """Whether ``rank`` marked itself told to stop: in the job's store, or (a peer on this host under ddpkit's
        agent) in the agent's stop directory, which outlives a store that rank 0 held and took along."""
        marked = _told_mark(rank)
        if marked is not None and os.path.exists(marked):
            return True
        try:
            return bool(self.monitor.store.check([f"term/{rank}"]))
        except Exception:
            return False

    def _peers_here(self, records: dict[int, Heartbeat | None]) -> dict[int, int]:
        """rank -> pid of the other ranks on this host, from their records."""
        m = self.monitor
        return {r: rec["pid"] for r, rec in records.items() if rec and r != m.rank and rec["host"] == m.rec.host}

    def _write(self, failed: dict[str, Any] | None) -> None:
        """A collective failed on this rank (gloo: "Connection reset by peer [addr]", an address, no rank), or
        (``failed`` None) this rank is told to stop while a rank on this host is gone: name the ranks that are gone
        or stopped, from their records. Quick: the launcher may end this rank any moment."""
        m, host = self.monitor, self.monitor.rec.host
        if not _claim_here():
            return  # a rank on this host wrote the report (its store may be gone since: rank 0 held it)
        try:
            if m.store.compare_set("failed", "", str(m.rank)).decode() != str(m.rank):
                return  # another rank's failure report says it (one report per job)
            records = m.read()
        except Exception as exc:  # the store left with its host (rank 0 under env://): say what this rank saw last
            if not m.last_read:
                raise
            log.debug("watch: the job's store is gone (%s): the report uses the records read last", exc)
            records = m.last_read
        if failed is not None:
            error = failed["error"].splitlines()[0] if failed["error"] else "(no message)"
            call = f"{failed['op']} #{failed['seq']}" if failed["seq"] is not None else failed["op"]
            headline = f"rank {m.rank} on host {host}: {call} (called at {failed['site']}) failed: {error[:300]}"
        else:
            headline = f"rank {m.rank} on host {host} is told to stop (SIGTERM: the launcher is ending the job)"
        peers, gone, left = self._peer_lines(records)
        if failed is None:
            headline += " while a rank on this host is gone" if gone or not left else " after " + "; ".join(
                f"rank {r} {'finished' if why == 'finished' else 'was stopped by ddpkit'}"
                for r, why in sorted(left.items()))
        hosts = {str(r): rec["host"] for r, rec in records.items() if rec}
        m.emit([f"ddpkit watch: {headline}", *peers],
               {"event": "collective-failed" if failed is not None else "rank-gone", "reporter": m.rank,
                "failed": failed, "gone": gone, "left": {str(r): why for r, why in left.items()}, "hosts": hosts})

    def _peer_lines(self, records: dict[int, Heartbeat | None]) -> tuple[list[str], list[int], dict[int, str]]:
        """A line per other rank worth naming, the ranks on this host that are gone or stopped, and those whose
        process ended in a known way (``_why_gone``: finished, or stopped by ddpkit's watch), by how."""
        m, host = self.monitor, self.monitor.rec.host
        now = time.monotonic()
        lines: list[str] = []
        local = self._peers_here(records)
        until = time.monotonic() + GONE_WAIT_S  # a killed peer's sockets close before its process is gone
        states = {r: process_state(pid) for r, pid in local.items()}
        while local and "gone" not in states.values() and time.monotonic() < until:
            time.sleep(0.02)
            states = {r: process_state(pid) for r, pid in local.items()}
        told = {r for r, state in states.items() if state == "gone" and self._told(r)}
        gone: list[int] = []
        left: dict[int, str] = {}
        for r, rec in sorted(records.items()):
            if rec is None or r == m.rank or r in told:  # a peer told to stop as well is no news
                continue
            state = states.get(r)
            if state == "gone" and (why := _why_gone(rec)) is not None:
                left[r] = why
                lines.append(f"  rank {r} on host {rec['host']} (pid {rec['pid']}) {LEFT_WORDS[why]}")
            elif state in ("gone", "stopped"):
                gone.append(r)
                lines.append(f"  rank {r} on host {rec['host']} (pid {rec['pid']}) is {state} "
                             f"({'its process no longer runs' if state == 'gone' else 'SIGSTOP'})")
            elif rec["host"] != host and r in m.seen:
                lines.append(f"  rank {r} on host {rec['host']}: last heartbeat seen {now - m.seen[r][1]:.1f} s ago")
        if not gone and told:
            lines.append(f"  no rank on this host is gone but rank(s) {', '.join(map(str, sorted(told)))}, told to "
                         "stop (SIGTERM) as this one is")
        elif not gone and not left:
            lines.append("  no rank on this host is gone; the failed peer is on another host (see its lines)")
        return lines, gone, left


#: How a peer whose process no longer runs ended, where that is known (``_why_gone``), in a report's words.
LEFT_WORDS = {"finished": "finished: it ended its process group and its process exited",
              "ended-by-watch": "was stopped by ddpkit (its watch ended it, exit 3, after a hang or a lost store)"}


def _finished(rec: Heartbeat | None) -> bool:
    return rec is not None and bool(rec.get("finished"))


def _why_gone(rec: Heartbeat) -> str | None:
    """How a peer on this host whose process is gone ended: ``finished`` (its last record says it ended well),
    ``ended-by-watch`` (ddpkit's watch ended it: its mark), None: unknown (killed, crashed, failed, exited)."""
    if _finished(rec):
        return "finished"
    return "ended-by-watch" if ended_by_watch(rec["pid"]) else None


def _claim_here() -> bool:
    """Whether this rank is the first on its host to write a report in this attempt (ddpkit's agent's stop directory;
    True elsewhere). The store's ``failed`` key says it for the job, but rank 0 holds the store under ddpkit's agent
    and takes it along when the launcher ends it: a peer told to stop a moment later would find no store, and write
    a second report from its last read."""
    mark = _agent_mark("watch-report")
    if mark is None:
        return True
    try:
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True  # no mark can be left: the store alone decides
    return True


def _told_mark(rank: int) -> str | None:
    """The file a rank told to stop leaves in ddpkit's agent's stop directory (per attempt), or None elsewhere."""
    return _agent_mark("watch-told", rank)


def _agent_mark(name: str, *more: object) -> str | None:
    """``STOP_DIR/NAME.RESTART[.MORE...]``: a mark of this attempt in ddpkit's agent's stop directory (which outlives
    the job's store), or None where no ddpkit agent started this rank."""
    context = WorkerContext.from_environ()
    if context.stop_dir is None:
        return None
    return os.path.join(context.stop_dir, ".".join(str(part) for part in (name, context.restart_count, *more)))
