"""What a rank's watch does once its loop (``monitor.py``) decided: report a hang or a passed phase deadline (first
rank to claim it) with every live rank's stacks, say once that progress resumed, and stop the job (every rank exits
3, the ranks that stopped answering ended by a live rank on their host). Under ``--heal live``, where the watch would
stop the job over ranks the others wait for, it names those ranks to the live agent instead
(``ddpkit.live.protocol``), which ends and replaces them while the others keep their processes.

Store keys (under the watch's prefix, ``monitor.py`` names them all): ``claim``, ``stacks/<claim>/<rank>``,
``abort``, ``abort/seen`` (the live ranks that saw the order), ``abort/handled`` (those whose abort handlers ran).
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit.base.errors import EXIT_MISSING
from ddpkit.base.fault_injection import fault
from ddpkit.base.log import get_logger
from ddpkit.process.stopping import leave_abort_order
from ddpkit.process.worker_context import WorkerContext
from ddpkit.watch.diagnose import Hang
from ddpkit.watch.processes import STACK_WAIT_S, end_stopped, python_stacks, stop_rank
from ddpkit.watch.records import AbortOrder, Heartbeat, StoppedRank

if TYPE_CHECKING:
    from ddpkit.watch.options import WatchOptions
    from ddpkit.watch.recorder import Recorder
    from ddpkit.watch.steplines import StepLines

__all__ = ["HANDLERS_WAIT_S", "Actions", "RankStacks", "Reported", "replace_hung_with", "where_main_runs"]

log = get_logger(__name__)
#: Under an abort, how long a rank waits for every live rank's abort handlers to have run before it exits.
HANDLERS_WAIT_S = 10.0
#: Under ``--heal live``: how this rank's watch hands a hung rank to the live agent (its pid, the report's headline);
#: set by the live wing when this rank joins a live group (``ddpkit.live.rank.group``); None: not healed live.
_replacer: Callable[[int, str], None] | None = None


def replace_hung_with(replacer: Callable[[int, str], None] | None) -> None:
    """Where the watch would stop the job over ranks the others wait for, it calls ``replacer(pid, headline)`` for
    each instead (the live agent ends and replaces them); None: stop the job, as without ``--heal live``."""
    global _replacer
    _replacer = replacer


@dataclass(frozen=True)
class RankStacks:
    """What a rank posts for a claim (``stacks/<claim>/<rank>``): every thread's Python stack, and the line of the
    user's code its main thread runs (``where_main_runs``)."""

    stacks: str
    where: str | None

    @classmethod
    def here(cls) -> RankStacks:
        return cls(stacks=python_stacks(), where=where_main_runs())

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes) -> RankStacks:
        return cls(**json.loads(raw.decode()))


def where_main_runs() -> str | None:
    """``torch.save(state, path) at job.py:20 (main)``: the innermost frame of the main thread outside torch, the
    standard library and the watch (the user's line that is running), or None."""
    import torch

    skip = (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"], os.path.dirname(__file__), "<")
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip):
            line = linecache.getline(name, frame.f_lineno).strip()
            return f"{line or '?'} at {os.path.basename(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


@dataclass
class Reported:
    """A claim this rank reported that has not ended: when the job last made progress before it, and where the
    ranks the others waited for were (``Hang.busy``). ``hang``: a hang (its end is said), not a phase deadline."""

    claim: str
    since: float
    hang: bool
    busy_at: dict[int, str] = field(default_factory=dict)
    waited_for: tuple[int, ...] = ()
    """The live ranks the others wait for (the report's ``behind``, else its ``busy``): under ``--heal live``, the
    ranks replaced where the watch would stop the job."""
    replaced: bool = False
    """Under ``--heal live``: ``waited_for`` was named to the live agent (once a report)."""


class MonitorView(Protocol):
    """What the actions read and set of their rank's watch (``watch.monitor.Monitor`` has it): a narrow view, so
    that the actions and the monitor, which owns them, do not import each other."""

    rank: int
    world: int
    beat: int
    rec: Recorder
    options: WatchOptions
    store: Any
    """The job's store, every call bounded (``watch.store.BoundedStore``)."""
    steplines: StepLines | None
    abort_handlers: list[Callable[[AbortOrder], object]]
    aborting: bool

    def read(self) -> dict[int, Heartbeat | None]: ...
    def emit(self, lines: list[str], event: dict[str, Any]) -> None: ...


class Actions:
    """The reports and stops of one rank's watch (``Monitor.actions``)."""

    def __init__(self, monitor: MonitorView) -> None:
        self.monitor = monitor
        self.reported: Reported | None = None
        """The claim this rank reported, until progress resumed (``resumed``)."""
        self._answered: set[str] = set()

    def answer(self, claim: str) -> None:
        """Post this rank's stacks for ``claim`` (another rank's report), once."""
        m = self.monitor
        if claim and claim not in self._answered:
            self._answered.add(claim)
            m.store.set(f"stacks/{claim}/{m.rank}", RankStacks.here().dumps())

    # -- the report -------------------------------------------------------------------------------------------
    def claim(self, records: dict[int, Heartbeat | None], stale: dict[int, float], mine: str,
              describe: Callable[[dict[int, Heartbeat | None], dict[int, str]], Hang], *, since: float,
              stop_at: float | None = None) -> None:
        """Report the hang ``mine`` names (first rank to claim it), worded by ``describe(records, where each live
        rank's main thread runs)``; ``since``: when the job last made progress. Under ``abort``, every rank stops
        now, or, when ``stop_at`` (the wall clock) is given, then (``Monitor._poll``) unless progress resumes
        first."""
        m = self.monitor
        if m.store.compare_set("claim", "", mine).decode() != mine:
            return  # another rank reports this one
        self.reported = Reported(claim=mine, since=since, hang=":phase" not in mine)
        self._answered.add(mine)
        m.store.set(f"stacks/{mine}/{m.rank}", RankStacks.here().dumps())
        live = [r for r in range(m.world) if records[r] is not None and r not in stale]
        keys = {r: f"stacks/{mine}/{r}" for r in live}
        until = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < until and not m.store.check(list(keys.values())):
            time.sleep(0.05)
        posted = {r: RankStacks.loads(m.store.get(k)) for r, k in keys.items() if m.store.check([k])}
        stacks = {r: p.stacks for r, p in posted.items()}
        try:
            where = {r: p.where for r, p in posted.items() if p.where is not None}
            hang = describe(m.read(), where)
            self.reported.busy_at = {r: where[r] for r in hang.busy if r in where}
            self.reported.waited_for = tuple(sorted(r for r in (hang.behind or hang.busy) if r not in stale))
        except Exception as exc:  # a report without its diagnosis beats silence (the loop takes errors for the store's)
            log.error("watch: the hang report could not be worded (%r)", exc)
            hang = Hang(lines=[f"ddpkit watch: HANG: no rank has made progress (claim {mine}); the diagnosis failed: "
                               f"{exc!r}; the stacks follow"], event={"event": "hang", "reporter": m.rank,
                                                                     "diagnosis_error": repr(exc)})
        lines = list(hang.lines)
        replace = self._replaceable(stop_at)
        if replace:
            lines[0] += (f"; rank(s) {', '.join(map(str, replace))} replaced live (--heal live), the others keep "
                         "their processes")
        elif m.options.on_hang == "report":
            lines[0] += "; the watch does not stop the job (--on-hang report)"
        elif stop_at is not None:
            lines[0] += f"; every rank stops at {time.strftime('%H:%M:%S', time.localtime(stop_at))} unless " \
                        "progress resumes"
            hang.event["stop_at"] = round(stop_at, 3)
        else:
            if hang.busy:  # --hang-after (or a --stop-after within it) declared this long a hang: it is one here
                lines[0] = lines[0].replace("ddpkit watch: ", "ddpkit watch: HANG: ", 1)
            lines[0] += f"; every rank stops now (exit {EXIT_MISSING})"
        for r in sorted(stacks, key=lambda r: (r not in hang.busy, r)):  # the ranks the others wait for first
            lines.append(f"--- rank {r} on {_where(records[r])}: Python stacks")
            lines.append(stacks[r].rstrip("\n"))
        silent = [r for r in live if r not in stacks]
        if silent:
            lines.append(f"--- no stacks from ranks {silent} within {STACK_WAIT_S:g} s")
        hang.event["stacks"] = {str(r): s for r, s in stacks.items()}
        hang.event["on_hang"] = m.options.on_hang
        m.emit(lines, hang.event)
        if replace:
            self._name_hung(records, replace, lines[0])
        elif m.options.on_hang == "abort" and stop_at is None:
            order = self._order(records, stale, lines[0], hang.event.get("text"))
            m.aborting = True
            m.store.set("abort", order.to_json())
            self._stop_every_rank(order)

    def resumed(self, now: float, *, said: bool) -> None:
        """Progress again after this rank's report: free the claim (a later hang gets its own report) and, for a
        hang, say once how long the job paused (``said``: progress resumed, not a marked phase begun)."""
        m = self.monitor
        reported, self.reported = self.reported, None
        assert reported is not None
        with contextlib.suppress(Exception):  # at the job's end the store's holder may have left
            m.store.compare_set("claim", reported.claim, "")
        if not (said and reported.hang):
            return
        paused = now - reported.since
        was = "; ".join(f"rank {r} was in {w}" for r, w in sorted(reported.busy_at.items()))
        m.emit([f"ddpkit watch: progress resumed after {paused:.0f} s" + (f" ({was})" if was else "")],
               {"event": "resumed", "reporter": m.rank, "paused_s": round(paused, 1),
                "busy_at": {str(r): w for r, w in reported.busy_at.items()}})

    def resumed_for(self, claim: str, *, since: float, at: float) -> None:
        """Progress resumed at ``at`` (this rank's clock) after another rank's report ``claim``, and that rank
        stopped answering before it freed the claim: free it, and say once (first rank to free it) how long the
        job paused."""
        m = self.monitor
        if m.store.add(f"freed/{claim}", 1) != 1:
            return  # another rank freed it
        m.store.compare_set("claim", claim, "")
        if ":phase" in claim:
            return
        m.emit([f"ddpkit watch: progress resumed after {at - since:.0f} s (the rank that reported the hang stopped "
                "answering since)"],
               {"event": "resumed", "reporter": m.rank, "paused_s": round(at - since, 1), "busy_at": {},
                "freed": claim})

    # -- stopping the job -------------------------------------------------------------------------------------
    def stop_job(self, records: dict[int, Heartbeat | None], stale: dict[int, float], idle: float,
                 stop: float) -> None:
        """No progress for ``stop`` s since a hang was reported: every rank stops (exit 3); one order per job."""
        m = self.monitor
        replace = self._replaceable(None)
        if replace:
            line = (f"ddpkit watch: no rank has made progress for {idle:.0f} s (stop after {stop:g} s): rank(s) "
                    f"{', '.join(map(str, replace))} replaced live (--heal live), the others keep their processes")
            m.emit([line], {"event": "replace", "reporter": m.rank, "idle_s": round(idle, 1),
                            "stop_after_s": stop, "ranks": list(replace)})
            self._name_hung(records, replace, line)
            return
        line = (f"ddpkit watch: no rank has made progress for {idle:.0f} s (stop after {stop:g} s): every rank "
                f"stops (exit {EXIT_MISSING})")
        order = self._order(records, stale, line, None)
        m.aborting = True
        won = m.store.compare_set("abort", "", order.to_json()).decode()
        if won == order.to_json():
            m.emit([line], {"event": "stop", "reporter": m.rank, "idle_s": round(idle, 1),
                            "stop_after_s": stop, "silent": sorted(stale)})
            self._stop_every_rank(order)
        else:
            self.abort(AbortOrder.from_json(won))  # another rank stops the job

    def stop_silent(self, records: dict[int, Heartbeat | None], stale: dict[int, float],
                    lost: dict[int, float]) -> None:
        """Under ``--heal`` (``options.silent_stop``): ranks whose heartbeat stopped that long (a stopped or killed
        process, a host cut off) stop the job at once, named, so that the supervisor relaunches without their host.
        Ranks that answer are never named here, however slow (their heartbeat changes)."""
        m = self.monitor
        mine = f"{m.rank}:silent:{m.beat}"
        if m.store.compare_set("claim", "", mine).decode() != mine:
            return  # another rank reports it
        named = "; ".join(f"rank {r} on {_where(records[r])} stopped answering: no heartbeat for {age:.0f} s"
                          for r, age in sorted(lost.items()))
        line = (f"ddpkit watch: {named} (under --heal a silent rank is a lost host after {m.options.silent_stop:g} "
                f"s); every rank stops now (exit {EXIT_MISSING})")
        order = self._order(records, stale, line, None)
        m.aborting = True
        m.emit([line], {"event": "silent", "reporter": m.rank, "silent_s": {str(r): round(a, 1)
                                                                             for r, a in lost.items()},
                        "hosts": {str(r): rec["host"] if (rec := records[r]) else None for r in lost}})
        m.store.set("abort", order.to_json())
        self._stop_every_rank(order)

    def _replaceable(self, stop_at: float | None) -> tuple[int, ...]:
        """Under ``--heal live`` where the watch would stop the job now (``--on-hang abort``, no later stop): the
        ranks this rank's report found the others waiting for, to be replaced live; () where there are none, where
        every rank is one (no live rank would hold the state) or outside ``--heal live``."""
        m, reported = self.monitor, self.reported
        if m.options.on_hang != "abort" or stop_at is not None or reported is None or reported.replaced:
            return ()
        if _replacer is None or len(reported.waited_for) >= m.world:
            return ()
        return reported.waited_for

    def _name_hung(self, records: dict[int, Heartbeat | None], ranks: tuple[int, ...], headline: str) -> None:
        """Hand the processes of ``ranks`` to the live agent as hung (``replace_hung_with``); it ends and replaces
        them."""
        replacer = _replacer
        assert replacer is not None and self.reported is not None
        self.reported.replaced = True
        for rank in ranks:
            rec = records.get(rank)
            if rec is not None:
                replacer(int(rec["pid"]), headline)

    def _order(self, records: dict[int, Heartbeat | None], stale: dict[int, float], headline: str,
               text: str | None) -> AbortOrder:
        """The abort order (``abort`` in the store): who stops the ranks that stopped answering on each host."""
        hosts = {r: rec["host"] for r, rec in records.items() if rec is not None}
        live = [r for r in hosts if r not in stale]
        doomed = tuple(StoppedRank(rank=r, host=hosts[r], pid=records[r]["pid"],  # type: ignore[index]
                                   by=min((q for q in live if hosts[q] == hosts[r]), default=None))
                       for r in stale if r in hosts)
        return AbortOrder.from_headline(self.monitor.rank, headline, stopped=doomed, silent=tuple(sorted(stale)),
                                        live=len(live), hosts=hosts, deadline=text)

    def _stop_every_rank(self, order: AbortOrder) -> None:
        """The order is in the store: wait (at most STACK_WAIT_S) until the other live ranks saw it, then stop."""
        store = self.monitor.store
        until = time.monotonic() + STACK_WAIT_S
        with contextlib.suppress(Exception):  # a rank that hosts the store may leave first, taking it along
            while time.monotonic() < until and int(store.add("abort/seen", 0)) < order.live - 1:
                time.sleep(0.05)
        self.abort(order)

    def abort(self, order: AbortOrder) -> None:
        """Stop this rank (exit 3); first stop the ranks that stopped answering on this host (SIGCONT, SIGKILL),
        which no signal of their own can end. ``os._exit``: a thread blocked in C cannot hold the process.

        No live rank leaves before every live rank's abort handlers ran (at most HANDLERS_WAIT_S): a launcher that
        sees one rank exit ends the others (torch's elastic agent sends SIGTERM), and a handler may be printing a
        report (``ddpkit check``'s rank 0) or leaving one for the agent (``train``). That also keeps a rank that
        hosts the job's store (rank 0 under ``ddpkit check`` or env://) until the others have seen the order."""
        m = self.monitor
        m.aborting = True
        if m.steplines is not None:  # the steps this rank ended are the run's goodput, up to this stop
            m.steplines.beat(final=True)
        host = m.rec.host
        mine = [d.pid for d in order.stopped if d.by == m.rank and d.host == host]
        if mine:
            end_stopped(mine)
        context = WorkerContext.from_environ()  # the order, for ddpkit's agent (a heal supervisor reads who was silent)
        leave_abort_order(context.stop_dir, context.restart_count, m.rank, order.to_json())
        if order.reporter != m.rank:
            with contextlib.suppress(Exception):  # the reporter may have left with its store
                m.store.add("abort/seen", 1)
        self.run_abort_handlers(order)
        with contextlib.suppress(Exception):  # a rank that hosted the store left (after its own handlers ran)
            handled = int(m.store.add("abort/handled", 1))
            until = time.monotonic() + HANDLERS_WAIT_S
            while handled < order.live and time.monotonic() < until:
                time.sleep(0.05)
                handled = int(m.store.add("abort/handled", 0))
        late = fault("abort-late", rank=m.rank)  # test hook: this rank leaves after the others
        if late is not None:
            time.sleep(float(late.get("ms", 1500)) / 1e3)
        stop_rank(None if order.reporter == m.rank else
                  f"ddpkit watch: rank {m.rank} on host {host} stops (hang reported by rank {order.reporter}; "
                  f"exit {EXIT_MISSING})")

    def run_abort_handlers(self, order: AbortOrder) -> None:
        """The command's own last words (``Session.on_abort``), each run whatever the one before did."""
        for handler in self.monitor.abort_handlers:
            try:
                handler(order)
            except Exception as exc:  # the rank stops anyway: a handler's failure must not keep it alive
                log.error("watch: an abort handler failed: %s", exc)


def _where(rec: Heartbeat | None) -> str:
    """``host H (pid P)`` of a rank's last record; ``host None (pid None)`` where it never published one."""
    return f"host {rec['host']} (pid {rec['pid']})" if rec else "host None (pid None)"
