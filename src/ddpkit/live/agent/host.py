"""Live healing on one host (``ddpkit train|run -n N --heal live``): each rank a process context of its own, forked by
torch's ``start_processes`` from this agent (which imported torch and the trainer once); the attempt is the shared
``live.agent.session``, whose agent (``live.agent.rules``) says what a lost rank is and how it is replaced."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.launch import worker
from ddpkit.launch.failure import TORCH_WORKER_LOGGER, drop_exit_tracebacks
from ddpkit.launch.ranklogs import file_tail
from ddpkit.launch.result import AttemptResult
from ddpkit.live.agent.proc import Proc, Seen, stat_of
from ddpkit.live.agent.session import LiveSession
from ddpkit.process.worker_context import LIVE_GEN
from ddpkit.rundir.ledger import LiveHook
from ddpkit.runtime import share_cores

if TYPE_CHECKING:
    from ddpkit.launch.agent import Entrypoint, LaunchOptions

__all__ = ["fork_ranks", "launch_live"]


@dataclass(kw_only=True)
class _Local:
    """A rank forked (or started afresh) by torch's ``start_processes``, a context of its own."""

    context: Any
    host: str
    silent_s: float = 0.0

    @property
    def pid(self) -> int:
        return int(self.context.pids()[0])

    def wait(self) -> int | None:
        result = self.context.wait(0)
        if result is None:
            return None
        failure = next(iter(result.failures.values()), None) if result.failures else None
        return 0 if failure is None else int(failure.exitcode)

    def look(self) -> tuple[Seen, int]:
        state, ticks = stat_of(self.pid)
        return Seen.of_state(state), ticks

    def heard_since(self, since: float) -> bool:
        return stat_of(self.pid)[0] not in ("", "Z", "X")  # read now: after ``since``; a zombie has ended

    def send(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def close(self) -> None:
        self.context.close()


def _stderr_kept(directory: str, rank: int, gen: str) -> Any:
    """torch's hook for where a rank's streams go: stdout to the terminal as it is; stderr to the terminal and to
    ``DIR/attempt-GEN/rank-R.stderr.log`` (one folder a generation: a replacement keeps its lost rank's log), where
    the supervisor reads a failed attempt's tracebacks (``ddpkit.heal.supervisor.gather``)."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class _Specs(LogsSpecs):
        @property
        def root_log_dir(self) -> str:
            return directory

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            folder = os.path.join(directory, f"attempt-{gen}")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"rank-{rank}.stderr.log")
            return LogsDest(stdouts={0: ""}, stderrs={0: path}, tee_stderrs={0: path},
                            error_files={0: os.path.join(folder, f"rank-{rank}.error.json")})

    return _Specs(log_dir=directory)


@dataclass(kw_only=True)
class _Forker:
    """One host's ranks (a ``live.agent.session.Spawner``): each forked from this agent (which imported torch and
    the trainer) by torch's ``start_processes``, a context of its own; started afresh where forking is not safe."""

    entrypoint: Entrypoint
    argv: list[str]
    forked: bool
    log_dir: str | None
    """Where each rank's stderr is kept (the attempt's directory); None: a temporary one, removed at the end."""
    host: str = field(default_factory=lambda: socket.gethostname().split(".", 1)[0])
    _temporary: str | None = None
    pids: dict[int, int] = field(default_factory=dict)
    """Rank -> its process now (``log_dir/pids.json``, for a person or a drill to find)."""

    def __call__(self, rank: int, env: dict[str, str]) -> Proc:
        from torch.distributed.elastic.multiprocessing import start_processes

        if self.log_dir is None and self._temporary is None:
            self._temporary = tempfile.mkdtemp(prefix="ddpkit-live-logs-")
        specs = _stderr_kept(self.log_dir or str(self._temporary), rank, env.get(LIVE_GEN, "0"))
        prefix = {0: ""}  # the rank's lines as it wrote them (torch's tee would add "[rankR0]:")
        if self.forked:
            context = start_processes(f"rank{rank}", worker.forked_worker(self.entrypoint.main), {0: (self.argv,)},
                                      {0: env}, specs, log_line_prefixes=prefix, start_method="fork")
        else:
            context = start_processes(f"rank{rank}", sys.executable, {0: ("-m", self.entrypoint.module, *self.argv)},
                                      {0: env}, specs, log_line_prefixes=prefix)
        started = _Local(context=context, host=self.host)
        self._say_pid(rank, started.pid)
        return started

    def stderr_tail(self, rank: int) -> str | None:
        """The end of rank ``rank``'s newest stderr log here (its last generation's), None where none was kept: what
        a failed attempt's classification reads (its traceback)."""
        root = self.log_dir or self._temporary
        newest = max(Path(root).glob(f"attempt-*/rank-{rank}.stderr.log"), key=_mtime, default=None) if root else None
        return file_tail(newest) if newest is not None else None

    def _say_pid(self, rank: int, pid: int) -> None:
        """``log_dir/pids.json``: each rank's process now (rank -> pid), written whole, then renamed."""
        self.pids[rank] = pid
        if self.log_dir is None:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "pids.json")
        with open(path + ".tmp", "w") as f:
            json.dump({str(r): p for r, p in sorted(self.pids.items())}, f)
        os.replace(path + ".tmp", path)

    def end(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def launch_live(options: LaunchOptions, entrypoint: Entrypoint, argv: list[str], on_heal: LiveHook) -> AttemptResult:
    """Run ``argv`` on ``options.shape.nproc_per_node`` local ranks, replacing a lost one live (``on_heal`` is told
    each heal, once the replacement trains); how the attempt ended, as ``launch()`` returns it."""
    from ddpkit.launch.agent import preload

    world = options.shape.nproc_per_node
    share_cores(world, announce=True)
    torch_log = logging.getLogger(TORCH_WORKER_LOGGER)
    torch_log.addFilter(drop_exit_tracebacks)
    os.environ[worker.LAUNCHED] = "1"
    os.environ[worker.LAUNCHED_AT] = str(worker.process_started_at())
    forked = preload(options.preload)
    session = LiveSession(world=world, address="127.0.0.1", run_id=options.run_id or f"ddpkit-live-{os.getpid()}",
                          on_heal=on_heal)
    try:
        result, _ = session.run(lambda store: _Forker(entrypoint=entrypoint, argv=argv, forked=forked,
                                                      log_dir=options.log_dir))
        return result
    finally:
        torch_log.removeFilter(drop_exit_tracebacks)


def fork_ranks(options: LaunchOptions, entrypoint: Entrypoint, argv: list[str]) -> _Forker:
    """This host's ranks of a job healed live across hosts (``live.agent.hosts``): torch and the program imported
    once here, each rank forked from this process when the agent gives it (``options.shape.nproc_per_node`` at most
    at a time, the cores shared among them)."""
    from ddpkit.launch.agent import preload

    share_cores(options.shape.nproc_per_node, announce=True)
    logging.getLogger(TORCH_WORKER_LOGGER).addFilter(drop_exit_tracebacks)
    os.environ[worker.LAUNCHED] = "1"
    os.environ[worker.LAUNCHED_AT] = str(worker.process_started_at())
    return _Forker(entrypoint=entrypoint, argv=argv, forked=preload(options.preload), log_dir=options.log_dir)
