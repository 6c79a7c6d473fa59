"""The watch: a hung or slow rank in a DDP job, named live with its host, and every rank's Python stack.

In a rank's process, before the user's script (``ddpkit run`` does this)::

    from ddpkit.watch import WatchOptions, install
    install(WatchOptions(hang_after=120, on_hang="abort", report_every=60, events=Path("events.jsonl")))
    runpy.run_path(script, run_name="__main__")

In the user's own code::

    rt = ddpkit.init(watch=True)                 # or: with ddpkit.watch(): ...
    with ddpkit.watch.phase("checkpoint"):       # a known long phase: no alarm while a rank is inside
        save(...)

The watch begins when the default process group exists (``init_process_group`` is wrapped) and ends when it is
destroyed (rank 0 prints the summary). Which modules do what: ``hooks.py`` and ``p2p.py`` (where collectives and
point-to-point calls are seen), ``calls.py`` (a rank's watched calls, as the per-call path keeps them),
``recorder.py`` (one rank's progress: its calls, steps, phases and record), ``monitor.py`` (the thread: store,
deadline), ``actions.py`` (the hang report, the job stopped), ``failure.py`` (a failed collective or a gone peer,
reported at once), ``sigterm.py`` (a rank its launcher ends), ``processes.py`` (this host's processes: state, stacks,
ending them), ``store.py`` (store calls bounded), ``diagnose.py`` and ``timings.py`` (the words, pure),
``options.py`` (the options and the deadline rule). docs/watch.md is the guide.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddpkit.base.log import get_logger
from ddpkit.process.exiting import caused_by_peer
from ddpkit.process.worker_context import WorkerContext
from ddpkit.watch.frames import hide_wrappers
from ddpkit.watch.options import MIN_SILENT_S, WatchOptions
from ddpkit.watch.recorder import Live
from ddpkit.watch.store import agent_store

if TYPE_CHECKING:
    import torch.distributed as dist

    from ddpkit.watch.hooks import Hooks
    from ddpkit.watch.monitor import Monitor
    from ddpkit.watch.recorder import Recorder
    from ddpkit.watch.records import AbortOrder
    from ddpkit.watch.steplines import StepLines

__all__ = ["Session", "WatchOptions", "active", "ended", "install", "note_exception", "phase", "regroup", "uninstall",
           "watch"]

log = get_logger(__name__)
STORE_TIMEOUT = timedelta(seconds=10)


class Session:
    """One installed watch: the patches, and once the group exists, this rank's recorder and monitor."""

    def __init__(self, options: WatchOptions) -> None:
        from ddpkit.watch.hooks import Hooks

        context = WorkerContext.from_environ()
        silent = context.heal_silent_s
        if context.live_gen is not None:  # --heal live: the agent sees a silent rank's process itself (killed, stopped)
            options = dataclasses.replace(options, silent_stop=None)
        elif options.silent_stop is None and silent is not None:  # a heal supervisor started this rank
            options = dataclasses.replace(options, silent_stop=max(silent, MIN_SILENT_S))
        self.options = options
        self.recorder: Recorder | None = None
        self.monitor: Monitor | None = None
        self.steplines: StepLines | None = None
        """``ddpkit run``'s goodput lines (``WatchOptions.goodput``): made when the group begins, ended by
        ``ended``."""
        self._abort_handlers: list[Callable[[AbortOrder], object]] = []
        self.exit_code: int | None = None
        """What the watched script returned (``ended``; ``ddpkit run``), None before it returned."""
        self.hooks: Hooks = Hooks(_live, self._begin, lambda: self.finish(finished=True))

    def _begin(self, init_args: dict[str, Any]) -> None:
        import torch.distributed as dist

        if self.recorder is not None or not dist.is_initialized():
            return
        self.begin_on(_watch_store(init_args), rank=dist.get_rank(), world_size=dist.get_world_size(), prefixed=True)

    def begin_on(self, store: dist.Store, *, rank: int, world_size: int, prefixed: bool = False) -> None:
        """Start watching now, before any process group, on ``store`` (a connection of the watch's own: the rank's
        main thread may be blocked in a call on its own). ``ddpkit check`` does this from its roll-call on.
        ``prefixed``: the store already has the watch's key prefix."""
        import torch.distributed as dist

        from ddpkit.watch.monitor import Monitor
        from ddpkit.watch.recorder import Recorder

        if self.recorder is not None:
            return
        recorder = Recorder(rank, world_size)
        self.monitor = Monitor(recorder, self.options, store if prefixed else dist.PrefixStore(_prefix(), store))
        self.monitor.abort_handlers = self._abort_handlers
        if self.options.goodput is not None and self.steplines is None:  # once: a second group is the same run
            from ddpkit.watch.steplines import StepLines

            self.steplines = StepLines(self.options.goodput, recorder)
        self.monitor.steplines = self.steplines
        self.monitor.start()
        self.recorder = recorder
        _sync_live()
        log.info("watch: rank %d of %d watched", rank, world_size)

    def on_abort(self, handler: Callable[[AbortOrder], object]) -> None:
        """Call ``handler(order)`` on the watch's thread just before this rank exits 3 after a hang report (quick:
        the other ranks are leaving too). ``order``: a ``watch.records.AbortOrder`` (its reporter, reason, the ranks
        that stopped answering, their hosts)."""
        self._abort_handlers.append(handler)

    def answering(self, wait: float) -> set[int] | None:
        """The ranks that still answer (``Monitor.answering``); None when the job's store does not answer, or when
        the watch has not begun (no process group yet)."""
        monitor = self.monitor
        return monitor.answering(wait) if monitor is not None else None

    def begin_if_ready(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            self._begin({})

    def finish(self, finished: bool | None = None) -> None:
        """The group is going: stop watching, summary on rank 0. Safe to call twice. ``finished``: the rank ended
        well (its script destroyed its process group); None: as far as the watch knows (its script returned 0)."""
        monitor, self.monitor, self.recorder = self.monitor, None, None
        _sync_live()
        if monitor is not None:
            monitor.await_abort()  # the script caught the abort's broken collective and is leaving: exit 3 still
            monitor.finish(finished=self.exit_code == 0 if finished is None else finished)


def _watch_store(init_args: dict[str, Any]) -> dist.Store:
    """A store connection of the watch's own (the rank's main thread may be blocked on the group's): the job's
    TCPStore at MASTER_ADDR:MASTER_PORT (torchrun's agent, or rank 0 under env:// and tcp://), else the group's."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    method = str(init_args.get("init_method") or "")
    context = WorkerContext.from_environ()
    host, port = context.master_addr, str(context.master_port) if context.master_port is not None else None
    if context.live_store is not None:  # --heal live: the agent's store, the same for every generation's group
        (host, live_port), method = context.live_store, ""
        port = str(live_port)
        init_args = {**init_args, "store": None}
    if method.startswith("tcp://"):
        host, _, port = method[len("tcp://"):].split("?")[0].rpartition(":")
    prefix = _prefix()
    if init_args.get("store") is None and host and port:
        try:
            # --heal live: the process's one connection to the agent's store, shared with its live group
            store: dist.Store = agent_store(host, int(port), STORE_TIMEOUT) if context.live_store is not None else \
                dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=STORE_TIMEOUT,
                              wait_for_workers=False)
            return dist.PrefixStore(prefix, store)
        except (RuntimeError, ValueError) as exc:
            log.info("watch: no own connection to %s:%s (%s); sharing the group's store", host, port, exc)
    return dist.PrefixStore(prefix, c10d._get_default_store())


def regroup(model: Any = None) -> None:
    """The default group is being re-formed in this process (``--heal live``, ``live.rank.group``): the watch lets
    go of the old group, and counts ``model`` (the DDP object wrapped again over the new one) from its next forward.
    Its heartbeats, records and reports go on: a re-formed group is the same job."""
    session = _session
    if session is not None and session.recorder is not None:
        session.recorder.forget_group()
    if model is not None:
        for key in ("_ddpkit_seen", "_ddpkit_watched"):
            model.__dict__.pop(key, None)


def _prefix() -> str:
    """One key namespace per restart of the job, and per watch in this process (every rank installs as many)."""
    context = WorkerContext.from_environ()
    return f"ddpkit-watch/{context.run_id}/{context.restart_count}/{_installs}/"


_session: Session | None = None
_live = Live()
_installs = 0
_saved_excepthook = sys.excepthook


def _sync_live() -> None:
    """``_live.recorder`` is the current watch's recorder: called wherever the watch or its recorder changes."""
    _live.recorder = _session.recorder if _session is not None else None
    _live.p2p = None  # the new recorder's book, once its first point-to-point call learned (``p2p.general``)


def active() -> Session | None:
    """The installed watch, or None."""
    return _session


def install(options: WatchOptions | None = None, *, store: dist.Store | None = None, rank: int | None = None,
            world_size: int | None = None) -> Session:
    """Watch this rank: call before the process group exists (or after: it starts at once). Idempotent.
    With ``store``, ``rank`` and ``world_size`` the watch starts now, on that store, before any process group
    (``Session.begin_on``)."""
    global _session, _installs, _saved_excepthook
    if _session is None:
        _installs += 1
        _session = Session(options or WatchOptions())
        _session.hooks.install()
        atexit.register(_at_exit)
        _saved_excepthook, sys.excepthook = sys.excepthook, _excepthook
    if store is not None:
        if rank is None or world_size is None:
            raise ValueError("install(store=...) needs rank and world_size")
        _session.begin_on(store, rank=rank, world_size=world_size)
    _session.begin_if_ready()
    _sync_live()
    return _session


def ended(code: int) -> None:
    """The watched script returned ``code`` (``ddpkit run``): its last goodput lines (``watch.steplines``), and its
    last record says whether it ended well (``Session.finish``)."""
    session = _session
    if session is not None:
        session.exit_code = code
    if session is None or session.steplines is None:
        return
    lines, session.steplines = session.steplines, None
    if session.monitor is not None:
        session.monitor.steplines = None
    lines.end(code)


def uninstall() -> None:
    """Stop watching (summary on rank 0 if the group still exists) and restore torch's functions."""
    global _session
    session, _session = _session, None
    _sync_live()
    if session is not None:
        session.finish()
        session.hooks.uninstall()
        if sys.excepthook is _excepthook:
            sys.excepthook = _saved_excepthook


def note_exception(exc: BaseException | None = None) -> None:
    """An exception is leaving the user's code: when it comes from a watched collective that failed (DDP raises a
    failed gradient bucket in ``backward``), the watch's failure report (which ranks are gone) is printed now, before
    the launcher ends this process. ``ddpkit run`` calls it; an uncaught exception does, through ``sys.excepthook``.
    With ``exc``: a backend's error that says a peer is gone is reported so too when no watched call saw it fail
    (DDP's C++ all-reduce is counted, not opened as a call: a killed peer was never named)."""
    session = _session
    if session is None:
        return
    hide_wrappers(exc)  # the traceback a user reads: the user's frames and torch's
    monitor = session.monitor
    if monitor is not None:
        monitor.await_abort()  # under an abort the exception is its doing: the rank exits 3, not 1
    recorder = session.recorder
    if recorder is None:
        return
    try:
        recorder.sweep()
        if recorder.failed is None and exc is not None and monitor is not None and caused_by_peer(exc):
            recorder.failed = {"seq": None, "op": f"a collective in step {recorder.steps + 1} (DDP's own, or one not "
                               "watched)", "site": _user_site(exc),
                               "error": str(exc).strip()}
            monitor.failures.now()
    except Exception as error:  # the report is a courtesy: the exception itself is what matters now
        log.debug("watch: no failure check (%s)", error)


def _user_site(exc: BaseException) -> str:
    """FILE:LINE of the innermost frame of ``exc`` outside torch and ddpkit: where the user's code called in."""
    import traceback

    torch_dir = os.sep + "torch" + os.sep
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        if torch_dir not in frame.filename and not frame.filename.startswith(ours) \
                and not frame.filename.startswith("<frozen"):
            site = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return site


def _excepthook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
    note_exception(value)
    if tb is not None and tb is not value.__traceback__:  # another's traceback to print: as it was given
        _saved_excepthook(kind, value, tb)
        return
    hide_wrappers(value)
    _saved_excepthook(kind, value, value.__traceback__)


def _at_exit() -> None:
    if _session is not None:
        _session.finish()


@contextmanager
def watch(options: WatchOptions | None = None, **fields: Any) -> Iterator[Session]:
    """``with ddpkit.watch(hang_after=60): ...``: watch the body (keyword arguments: WatchOptions' fields)."""
    session = install(options or WatchOptions(**fields))
    try:
        yield session
    finally:
        uninstall()


@contextmanager
def phase(name: str, deadline: float | None = None) -> Iterator[None]:
    """A known long phase on this rank (a checkpoint, an evaluation): while any rank is inside one, no hang is
    reported, however long the others wait. With ``deadline`` (seconds) the phase is bounded: when this rank has
    been inside it longer, the watch reports (the ranks that had not reached the phase, the ones behind in a
    collective or stopped, every live rank's stacks) and, under ``on_hang="abort"``, stops every rank (exit 3).
    ``ddpkit check`` runs each of its phases this way. Does nothing when no watch is installed."""
    recorder = _session.recorder if _session is not None else None
    if recorder is None:
        yield
        return
    if deadline is not None and not deadline > 0:
        raise ValueError(f"phase {name!r}: deadline {deadline!r} s; expected a number of seconds above 0")
    recorder.phase_begin(name, deadline)
    try:
        yield
    finally:
        recorder.phase_end()


class _CallableModule(types.ModuleType):
    """``ddpkit.watch`` is this package and also ``with ddpkit.watch(): ...``."""

    def __call__(self, options: WatchOptions | None = None, **fields: Any) -> Any:
        return watch(options, **fields)


sys.modules[__name__].__class__ = _CallableModule
