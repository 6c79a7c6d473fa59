"""The watch's thread on every rank: publish this rank's progress in the job's store, watch everyone's, and when no
rank has progressed past the deadline, report once (first rank to claim it) with every live rank's stacks; under
``--on-hang abort``, stop every rank once no progress was made for ``--stop-after`` (``options.stop_deadline``).
When progress resumes after a report, the reporter says so once and frees the claim (a later hang gets its own).

Store keys (under a prefix per job and restart): ``rec/<rank>`` (this rank's record, every heartbeat),
``claim`` (the hang being reported: ``<reporter>:<collective>:<beat>``, first writer wins; empty again once
progress resumed), ``freed/<claim>`` (counts the ranks that freed a claim whose reporter stopped answering),
``stacks/<claim>/<rank>`` (each live rank's ``RankStacks``, posted when it sees a claim),
``abort`` (the ranks to stop, set by the rank that stops the job), ``final/<rank>`` (the last record, for the exit
summary).

The thread runs while the rank's main thread sits in a collective (the backends release the GIL there), so a rank
blocked in gloo, MPI or NCCL still answers; a rank that is stopped (SIGSTOP), killed, or on a lost host does not,
and its heartbeat stops changing.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import EXIT_MISSING, first_line
from ddpkit.base.log import get_logger
from ddpkit.watch.actions import HANDLERS_WAIT_S, Actions
from ddpkit.watch.diagnose import diagnose_deadline, diagnose_hang
from ddpkit.watch.failure import FailureReport
from ddpkit.watch.options import WatchOptions, hang_deadline, made_a_step, stop_deadline
from ddpkit.watch.processes import STACK_WAIT_S, python_stacks, stop_rank, write_lines
from ddpkit.watch.recorder import Recorder
from ddpkit.watch.records import AbortOrder, Heartbeat
from ddpkit.watch.steplines import StepLines
from ddpkit.watch.store import BoundedStore
from ddpkit.watch.storeloss import StoreLoss, holder_left
from ddpkit.watch.timings import straggler, summary_lines

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["Monitor"]

log = get_logger(__name__)
#: A heartbeat unchanged this long (and at least 6 heartbeats) means the rank stopped answering. No hang is
#: reported before a stop could be told (the report waits at least this long past the last progress).
STALE_S = 3.0
#: The longest an exception caused by the abort waits for the watch's thread to end the rank (report, handlers).
ABORT_WAIT_S = STACK_WAIT_S + HANDLERS_WAIT_S + 5.0
#: How long rank 0 waits for the other ranks' last records before printing the summary.
FINAL_WAIT_S = 3.0
#: The longest the watch waits for one answer of the job's store (``watch/store.py``: TCPStore's own timeout does not
#: hold when the store's host stops answering).
STORE_CALL_S = 10.0
#: A rank other than the reporter stops the job this long after the time the report gave (the reporter stops it at
#: that time, unless it went silent since).
STOP_GRACE_S = 5.0


class Monitor:
    """The watch thread of one rank. ``start()`` once the process group exists; ``finish()`` before it goes."""

    def __init__(self, recorder: Recorder, options: WatchOptions, store: dist.Store) -> None:
        self.rec = recorder
        self.options = options
        self.store = BoundedStore(store, STORE_CALL_S)
        self.rank, self.world = recorder.rank, recorder.world_size
        self.keys = [f"rec/{r}" for r in range(self.world)]
        self.beat = 0
        self.last_read: dict[int, Heartbeat | None] = {}
        """The records of the last ``read`` that the store answered: what a report says once the store is gone."""
        self._stop = threading.Event()
        self.failures = FailureReport(self)
        self.actions = Actions(self)  # the reports and stops the loop decides on
        recorder.on_failure = self.failures.now  # a collective failed on this rank: report at once
        self._thread = threading.Thread(target=self._loop, name="ddpkit-watch", daemon=True)
        # observations, on this rank's clock
        self.seen: dict[int, tuple[Any, float]] = {}  # rank -> (heartbeat, when it last changed)
        self._progress: tuple[Any, ...] | None = None
        self._progress_at = time.monotonic()
        self._slowest_gap = 0.0
        self._overdue: set[int] = set()  # this rank's phases whose passed deadline was claimed
        self._progressed_under: tuple[str, float, float] | None = None
        """Another rank's claim under which this rank saw progress: (claim, last progress before, seen at)."""
        self.aborting = False  # a hang report ordered every rank to stop: a collective failing now is the abort
        self._next_straggler = time.monotonic() + options.report_every
        self._store_failed_at: float | None = None
        self._alone: StoreLoss | None = None  # this rank's watch while the store does not answer
        self.abort_handlers: list[Callable[[AbortOrder], object]] = []
        """Run on the watch's thread, in order, just before this rank exits 3 (``Session.on_abort``)."""
        self.steplines: StepLines | None = None
        """This rank's goodput lines (``WatchOptions.goodput``), written on the watch's thread."""

    def start(self) -> Monitor:
        self._publish()
        self._thread.start()
        return self

    # -- the loop ---------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        poll_every = max(1, round(1.0 / self.options.heartbeat))
        while not self._stop.wait(self.options.heartbeat):
            try:
                if self.steplines is not None:
                    self.steplines.beat()  # a file of its own: before the store, which may be gone
                self._publish()
                if self.beat % poll_every == 0:
                    self._poll()
                self._store_failed_at, self._alone = None, None
            except Exception as exc:  # the store is the only thing that can fail here
                if self._stop.is_set():
                    return
                self._store_trouble(exc)

    def _publish(self) -> None:
        self.beat += 1
        self.store.set(self.keys[self.rank], json.dumps(self.rec.record(self.beat)))

    def read(self) -> dict[int, Heartbeat | None]:
        present = [r for r in range(self.world) if self.store.check([self.keys[r]])] \
            if len(self.seen) < self.world else list(range(self.world))
        values = self.store.multi_get([self.keys[r] for r in present]) if present else []
        out: dict[int, Heartbeat | None] = dict.fromkeys(range(self.world))
        for r, raw in zip(present, values, strict=True):
            out[r] = json.loads(bytes(raw).decode())
        self.last_read = out
        return out

    def _poll(self) -> None:
        now = time.monotonic()
        claim = self.store.get("claim").decode() if self.store.check(["claim"]) else ""
        self.actions.answer(claim)
        if self.store.check(["abort"]):
            self.actions.abort(AbortOrder.from_json(self.store.get("abort")))
        records = self.read()
        for r, rec in records.items():
            if rec is not None and (r not in self.seen or self.seen[r][0] != rec["beat"]):
                self.seen[r] = (rec["beat"], now)
        stale = {r: now - at for r, (_, at) in self.seen.items()
                 if now - at > max(STALE_S, 6 * self.options.heartbeat) and not _final(records[r])}
        claim = self._free_orphaned(claim, stale)
        silent = self.options.silent_stop
        lost = {r: age for r, age in stale.items() if silent is not None and age >= silent}
        if lost and not claim:  # under --heal a silent rank is a lost host now, not at the hang deadline
            self.actions.stop_silent(records, stale, lost)
            return
        overdue = self.rec.overdue()
        if overdue is not None and overdue[0] not in self._overdue and not claim:
            self._overdue.add(overdue[0])  # each phase's deadline is reported once, whatever --on-hang says
            self.actions.claim(records, stale, f"{self.rank}:phase{overdue[0]}:{self.beat}",
                               lambda recs, _: diagnose_deadline(recs, stale, overdue=overdue, reporter=self.rank),
                               since=self._progress_at)
            return
        alive = {r: rec for r, rec in records.items() if rec is not None}
        if self.rank == 0 and now >= self._next_straggler:
            self._next_straggler = now + self.options.report_every
            found = straggler(alive, self.options.straggler_share) if len(alive) == self.world else None
            if found is not None:
                self.emit([found[0]], found[1])
        progress = tuple((r, rec["entered"], rec["completed"], rec.get("group_seq"))
                         for r, rec in sorted(alive.items()))
        in_phase = any(rec.get("phase") for r, rec in alive.items() if r not in stale)
        if progress != self._progress or in_phase:
            if progress != self._progress and not in_phase:
                self._slowest_gap = max(self._slowest_gap, now - self._progress_at)
            if self.actions.reported is not None:
                self.actions.resumed(now, said=progress != self._progress)
            elif claim and progress != self._progress:
                self._progressed_under = (claim, self._progress_at, now)
            self._progress, self._progress_at = progress, now
            return
        idle = now - self._progress_at
        deadline = max(hang_deadline(self.options, slowest_gap=self._slowest_gap,
                                     first_step_done=made_a_step(alive.values())), STALE_S + 1)
        stop = stop_deadline(self.options, report_deadline=deadline)
        # a rank on DDP's C++ path is seen waiting only by count: some rank has issued more collectives than another
        counts = {rec["group_seq"] for r, rec in alive.items() if r not in stale and rec.get("group_seq") is not None}
        waiting = any(rec.get("waiting") for r, rec in alive.items() if r not in stale) or len(counts) > 1
        if idle > deadline and (waiting or stale) and not claim:
            seqs = [w["seq"] for rec in records.values() if rec and (w := rec["waiting"])]
            self.actions.claim(records, stale, f"{self.rank}:{min(seqs) if seqs else 0}:{self.beat}",
                               lambda recs, at: diagnose_hang(recs, stale, idle=idle, deadline=deadline,
                                                              reporter=self.rank, busy_at=at),
                               since=self._progress_at,
                               stop_at=None if stop is None or stop <= deadline else time.time() + stop - idle)
        elif claim and stop is not None and stop > deadline and (waiting or stale):
            mine = self.actions.reported is not None and self.actions.reported.claim == claim
            if idle > stop + (0 if mine else STOP_GRACE_S):  # the reporter went silent: another rank stops the job
                self.actions.stop_job(records, stale, idle, stop)

    def _free_orphaned(self, claim: str, stale: dict[int, float]) -> str:
        """The claim in force: "" where progress resumed under another rank's report and that rank stopped
        answering before it saw so (it frees its claim at its next poll, a second at most; one stopped in between
        would keep a later hang from being reported). This rank frees it and says progress resumed."""
        under = self._progressed_under
        if not claim or under is None or under[0] != claim:
            return claim
        reporter = claim.split(":", 1)[0]
        if not reporter.isdigit() or int(reporter) not in stale:
            return claim
        self._progressed_under = None
        self.actions.resumed_for(claim, since=under[1], at=under[2])
        return ""

    # -- what the watch says, and this rank's end under an abort (``actions.py`` decides it) -------------------
    def emit(self, lines: list[str], event: dict[str, Any]) -> None:
        sys.stdout.flush()
        # the process's own stderr, not sys.stderr: torch's excepthook (installed by init_process_group) swaps
        # sys.stderr for a StringIO while the hooks before it run, ours included, and writes that out only after; a
        # launcher's SIGTERM in between lost the report (CI: [2-kill], the event written and no line printed)
        write_lines(lines)
        if self.options.events is not None:
            event = {"time": round(time.time(), 3), **event}
            try:
                with open(self.options.events, "a", encoding="utf-8") as f:
                    f.write(json.dumps(event) + "\n")
            except OSError as exc:  # the report is on stderr already: a lost events file must not end the job
                log.warning("watch: could not append to --events %s (%s)", self.options.events, exc)

    def await_abort(self) -> None:
        """Under an abort (a hang report ordered every rank to stop), an exception leaving the user's code now is the
        abort's doing: a rank that already left broke this rank's collective ("Connection closed by peer"). Keep the
        process for the watch's thread, which ends it with exit 3 once the handlers ran, rather than letting the
        exception end it with 1 (the launcher would name this rank as the one that failed first). Returns at once
        when no abort is under way; ends the process itself after ABORT_WAIT_S."""
        if not self.aborting or self._thread is threading.current_thread():
            return
        self._thread.join(timeout=ABORT_WAIT_S)
        stop_rank(f"ddpkit watch: rank {self.rank} on host {self.rec.host} stops (hang reported; exit {EXIT_MISSING})")

    def answering(self, wait: float) -> set[int] | None:
        """The ranks that still answer: their heartbeat changed after this call, or their record says they saw a
        collective fail themselves (alive then; they may be leaving now). Waits until every rank answered or
        ``wait`` s passed. None: the job's store does not answer this rank (its host is gone or cut off)."""
        since = time.monotonic()
        until = since + wait
        first: dict[int, Any] = {}
        answered = {self.rank}
        while True:
            try:
                records = self.read()
            except Exception as exc:
                log.debug("watch: the job's store does not answer (%s)", exc)
                return None
            for r, rec in records.items():
                if rec is None:
                    continue
                first.setdefault(r, rec["beat"])
                if rec["beat"] != first[r] or rec.get("failed") or rec.get("final"):
                    answered.add(r)
            if len(answered) == self.world or time.monotonic() >= until:
                return answered
            time.sleep(min(self.options.heartbeat, 0.2))

    def _store_trouble(self, exc: Exception) -> None:
        """The store went away. At the end of a job that is normal (its host finished first); while this rank waits
        in a collective it means the store's host is gone: report that (with this rank's stacks) after STALE_S."""
        now = time.monotonic()
        self._store_failed_at = self._store_failed_at or now
        if now - self._store_failed_at < STALE_S:
            return
        rec = self.rec.record(self.beat)
        if not rec["waiting"]:  # on DDP's C++ path a blocked rank waits in no watched call: watch on alone
            if self._alone is None and holder_left(self.last_read, self.rec.host):
                log.debug("watch: the job's store is gone with its holder, which left (%s): watching stops", exc)
                self._stop.set()
                return
            if self._alone is None:
                log.debug("watch: the job's store does not answer (%s): this rank watches its own progress", exc)
                r = self.rec
                self._alone = StoreLoss(rank=self.rank, host=r.host, options=self.options, records=self.last_read,
                                        progress=lambda: (r.entered, r.steps, r.p2p.returned, r.group_seq()),
                                        emit=self.emit, stop=stop_rank,
                                        abort_handlers=self.actions.run_abort_handlers,
                                        error=str(exc).strip().split("\n")[0],
                                        since=min(self._progress_at, self._store_failed_at),
                                        slowest_gap=self._slowest_gap,
                                        first_step_done=rec["first_step_done"] or made_a_step(self.last_read.values()))
            self._alone.tick(now)
            return
        w = rec["waiting"]
        lines = [f"ddpkit watch: HANG: rank {self.rank} on host {self.rec.host} has waited {w['for']:.0f} s in "
                 f"{w['op']} #{w['seq']} (called at {w['site']}) and the job's store no longer answers it "
                 f"({first_line(exc)}): the process that hosts it (the torchrun agent, or rank 0) is gone, or this "
                 "host is cut off from its host",
                 f"--- rank {self.rank} on host {self.rec.host} (pid {os.getpid()}): Python stacks", python_stacks()]
        self.emit(lines, {"event": "hang", "reporter": self.rank, "store_lost": str(exc), "waiting": w})
        if self.options.on_hang == "abort":
            self.actions.run_abort_handlers(AbortOrder.from_headline(self.rank, lines[0], silent=None,
                                                                     store_lost=str(exc)))
            stop_rank(None)
        self._stop.set()

    # -- the end ----------------------------------------------------------------------------------------------
    def finish(self, finished: bool = False) -> None:
        """Stop watching; publish the last record (``finished``: the rank ended well, so a peer does not call it gone);
        rank 0 prints the summary (waiting at most FINAL_WAIT_S)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.options.heartbeat + 1)
        if self.actions.reported is not None:  # the job ends normally after a reported pause: progress resumed first
            self.actions.resumed(time.monotonic(), said=True)
        try:
            last = json.dumps({**self.rec.record(self.beat + 1, final=True), "finished": finished})
            self.store.set(self.keys[self.rank], last)  # the others see this rank finished, not silent
            self.store.set(f"final/{self.rank}", last)
            if self.rank != 0 or not self.options.summary:
                return
            keys = [f"final/{r}" for r in range(self.world)]
            until = time.monotonic() + FINAL_WAIT_S
            while time.monotonic() < until and not self.store.check(keys):
                time.sleep(0.05)
            finals = {r: json.loads(self.store.get(k).decode()) for r, k in enumerate(keys) if self.store.check([k])}
        except Exception as exc:  # the store's host already left: no summary, say nothing false
            log.debug("watch: no summary (%s)", exc)
            return
        lines, event = summary_lines(finals)
        if lines:
            missing = sorted(set(range(self.world)) - set(finals))
            if missing:
                lines.append(f"  (no final record from ranks {missing} within {FINAL_WAIT_S:g} s)")
            self.emit(lines, event)


def _final(rec: Heartbeat | None) -> bool:
    """Whether ``rec`` is a rank's last record (it finished: never a hang)."""
    return rec is not None and rec["final"]
