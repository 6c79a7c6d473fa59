"""Live healing on one host (``ddpkit train|run -n N --heal live``): each rank a process context of its own, forked by
torch's ``start_processes`` from this agent (which imported torch and the trainer once), watched by the agent of
``ddpkit.live.agent.rules``, whose rules say what a lost rank is and how it is replaced."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ddpkit.launch import worker
from ddpkit.launch.failure import TORCH_WORKER_LOGGER, drop_exit_tracebacks
from ddpkit.launch.result import AttemptResult
from ddpkit.launch.stops import FORWARDED
from ddpkit.live.agent.rules import LiveAgent, Proc, rank_env
from ddpkit.process.worker_context import LIVE_GEN, PREEMPTED_MARK, STOP_DIR
from ddpkit.rundir.ledger import RankReplaced, ReplicasDiverged
from ddpkit.runtime import share_cores

if TYPE_CHECKING:
    from ddpkit.launch.agent import Entrypoint, LaunchOptions

__all__ = ["launch_live"]


@dataclass(kw_only=True)
class _Local:
    """A rank forked (or started afresh) by torch's ``start_processes``, a context of its own."""

    context: Any
    host: str
    stopped_word: str = "stopped (SIGSTOP)"
    unseen_s: float = 0.0

    @property
    def pid(self) -> int:
        return int(self.context.pids()[0])

    def wait(self) -> int | None:
        result = self.context.wait(0)
        if result is None:
            return None
        failure = next(iter(result.failures.values()), None) if result.failures else None
        return 0 if failure is None else int(failure.exitcode)

    def look(self) -> tuple[str, int]:
        return _stat(self.pid)

    def send(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def close(self) -> None:
        self.context.close()


def _stat(pid: int) -> tuple[str, int]:
    """The kernel's one-letter state of ``pid`` (R, S, D, T...) and the CPU time it used, all its threads, in clock
    ticks (utime + stime); ("", -1) where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return "", -1


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
    """One host's ranks: each forked from this agent (which imported torch and the trainer) by torch's
    ``start_processes``, a context of its own; started afresh where forking is not safe."""

    entrypoint: Entrypoint
    argv: list[str]
    forked: bool
    logs_dir: str
    """Where each rank's stderr is kept (the attempt's directory, or a temporary one)."""
    host: str = field(default_factory=lambda: socket.gethostname().split(".", 1)[0])

    def __call__(self, rank: int, env: dict[str, str]) -> Proc:
        from torch.distributed.elastic.multiprocessing import start_processes

        specs = _stderr_kept(self.logs_dir, rank, env.get(LIVE_GEN, "0"))
        prefix = {0: ""}  # the rank's lines as it wrote them (torch's tee would add "[rankR0]:")
        if self.forked:
            context = start_processes(f"rank{rank}", worker.forked_worker(self.entrypoint.main), {0: (self.argv,)},
                                      {0: env}, specs, log_line_prefixes=prefix, start_method="fork")
        else:
            context = start_processes(f"rank{rank}", sys.executable, {0: ("-m", self.entrypoint.module, *self.argv)},
                                      {0: env}, specs, log_line_prefixes=prefix)
        return _Local(context=context, host=self.host)


def launch_live(options: LaunchOptions, entrypoint: Entrypoint, argv: list[str],
                on_heal: Callable[[RankReplaced | ReplicasDiverged], None]) -> AttemptResult:
    """Run ``argv`` on ``options.shape.nproc_per_node`` local ranks, replacing a lost one live (``on_heal`` is told
    each heal, once the replacement trains); how the attempt ended, as ``launch()`` returns it."""
    import torch.distributed as dist

    from ddpkit.launch.agent import preload

    world = options.shape.nproc_per_node
    share_cores(world, announce=True)
    torch_log = logging.getLogger(TORCH_WORKER_LOGGER)
    torch_log.addFilter(drop_exit_tracebacks)
    marks = tempfile.mkdtemp(prefix="ddpkit-live-")
    os.environ[worker.LAUNCHED] = "1"
    os.environ[worker.LAUNCHED_AT] = str(worker.process_started_at())
    os.environ[STOP_DIR] = os.path.join(marks, "stops")
    os.mkdir(os.environ[STOP_DIR])
    os.environ[PREEMPTED_MARK] = os.path.join(marks, "preempted")
    forked = preload(options.preload)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spawn = _Forker(entrypoint=entrypoint, argv=argv, forked=forked, logs_dir=options.log_dir or marks)
    agent = LiveAgent(spawn=spawn, on_heal=on_heal, store=store, log_dir=options.log_dir)
    before = {name: signal.signal(getattr(signal, name), agent.on_outside_signal) for name in ("SIGINT", *FORWARDED)}
    run_id = options.run_id or f"ddpkit-live-{os.getpid()}"
    try:
        return agent.run({rank: rank_env(rank, world, address="127.0.0.1", port=store.port, run_id=run_id)
                          for rank in range(world)})
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
        agent._stop_all(signal.SIGKILL)
        torch_log.removeFilter(drop_exit_tracebacks)
        shutil.rmtree(marks, ignore_errors=True)
