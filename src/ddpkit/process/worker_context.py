"""What a worker knows of how it was started, read once from its environment: the bottom of the house (no torch,
no import of any other ddpkit module).

ddpkit's agent (``ddpkit.launch.agent``) exports the ``DDPKIT_*`` variables named here before it starts its
workers; torch's elastic agent (and torchrun) exports ``TORCHELASTIC_*``, ``MASTER_ADDR`` and ``MASTER_PORT``.
Each name is defined here once; ``WorkerContext.from_environ()`` is the one place that reads them for a worker::

    ctx = WorkerContext.from_environ()
    ctx.launched_by_ddpkit, ctx.restart_count, ctx.max_restarts, ctx.stop_dir, ctx.master
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.base.inputs import HEAL_SILENT_DEFAULT_S  # its default under every --heal backend, read with the option

__all__ = [
    "HEAL_SILENT_DEFAULT_S",
    "HEAL_SILENT_S",
    "LAUNCHED",
    "LAUNCHED_AT",
    "LIVE_GEN",
    "LIVE_STORE",
    "PREEMPTED_MARK",
    "RESULT_DIR",
    "START_METHOD",
    "STOP_DIR",
    "WorkerContext",
    "command_started_at",
    "launched_by_ddpkit",
    "process_started_at",
]

#: "1" in every worker of ddpkit's launcher: its -n/-j were already honoured.
LAUNCHED = "DDPKIT_LAUNCHED"
#: When the agent process started (epoch seconds): the command's start, as its workers report it.
LAUNCHED_AT = "DDPKIT_LAUNCHED_AT"
#: A directory where verdict commands' workers leave their exit code (launch.worker: verdict_exit_code, read_verdict).
RESULT_DIR = "DDPKIT_RESULT_DIR"
#: A path a worker that stopped cleanly after a preemption signal writes its exit code to, so the agent can say so.
PREEMPTED_MARK = "DDPKIT_PREEMPTED_MARK"
#: A directory shared by the agent and its workers about why the workers stop (the protocol: ddpkit.process.stopping).
STOP_DIR = "DDPKIT_STOP_DIR"
#: Set by a heal supervisor (``ddpkit submit slurm --heal``): seconds after which a rank whose heartbeat stopped is a
#: lost host and every rank stops at once (the watch's ``WatchOptions.silent_stop``), not at the hang deadline.
HEAL_SILENT_S = "DDPKIT_HEAL_SILENT_S"
#: ``fork`` (default with a CPU build of torch: workers forked from the agent, preloaded modules inherited) or
#: ``spawn`` (fresh processes; always with a CUDA build, see launch.agent.preload).
START_METHOD = "DDPKIT_START_METHOD"
#: Under ``--heal live`` (ddpkit.live.agent.rules): the generation of the group this worker joins, "0" for the first; a
#: replacement's is the generation made for it, and it takes its state from a live peer instead of a snapshot.
LIVE_GEN = "DDPKIT_LIVE_GEN"
#: Under ``--heal live``: HOST:PORT of the live agent's store, where its plans are (a generation's group has its own
#: store, at MASTER_ADDR:MASTER_PORT).
LIVE_STORE = "DDPKIT_LIVE_STORE"


def _int(text: str | None, default: int = 0) -> int:
    text = (text or "").strip()
    return int(text) if text.isdigit() else default


def _endpoint(text: str | None) -> tuple[str, int] | None:
    host, _, port = (text or "").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _seconds(text: str | None) -> float | None:
    """A positive finite number of seconds, else None (a value ddpkit did not write is ignored, not guessed at)."""
    try:
        value = float((text or "").strip())
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def launched_by_ddpkit(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker that ddpkit's own launcher started."""
    return (os.environ if environ is None else environ).get(LAUNCHED) == "1"


def process_started_at() -> float:
    """When this process started, in epoch seconds (from /proc, to 10 ms, on Linux; elsewhere the time of the call)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: the time of this call
        return time.time()
    return time.time() - max(0.0, age)


def command_started_at(environ: Mapping[str, str] | None = None) -> float:
    """When the command started, in epoch seconds: its agent's start in a worker of ddpkit's launcher, else this
    process's start (under another launcher, the rank's own start: the launcher's is not known)."""
    try:
        return float((os.environ if environ is None else environ).get(LAUNCHED_AT, ""))
    except ValueError:
        return process_started_at()


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """How this worker was started, as its launcher told it."""

    launched_by_ddpkit: bool
    """ddpkit's own agent started this worker (``DDPKIT_LAUNCHED=1``)."""
    started_at: float
    """When the command started (the agent's start under ddpkit's launcher, else this process's), epoch seconds."""
    stop_dir: str | None
    """The agent's directory about why workers stop (ddpkit.process.stopping); None under other launchers."""
    preempted_mark: str | None
    """Where a preempted worker leaves its exit code for ddpkit's agent; None under other launchers."""
    result_dir: str | None
    """Where verdict commands' workers leave their exit code for ddpkit's agent; None under other launchers."""
    restart_count: int
    """Which attempt this is (``TORCHELASTIC_RESTART_COUNT``; 0: the first, or no elastic agent)."""
    max_restarts: int
    """How many restarts the elastic agent allows (``TORCHELASTIC_MAX_RESTARTS``; 0 without one)."""
    run_id: str
    """The elastic run's id (``TORCHELASTIC_RUN_ID``), or ``run``."""
    master_addr: str | None
    """Rank 0's host, where the workers' store listens (``MASTER_ADDR``)."""
    master_port: int | None
    """The workers' store's port (``MASTER_PORT``)."""
    heal_silent_s: float | None = None
    """Under a heal supervisor: a rank silent this long stops the job at once (``HEAL_SILENT_S``); None otherwise."""
    agent_store: bool = False
    """The workers share their elastic agent's store (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun's default);
    else rank 0 creates the store at MASTER_ADDR:MASTER_PORT (ddpkit's agent, mpirun, srun)."""
    error_file: str | None = None
    """Where the elastic agent reads a failed worker's exception (``TORCHELASTIC_ERROR_FILE``, torch's ``@record``
    format): its "Root Cause" box then shows the rank's own traceback; None without an elastic agent."""
    live_gen: int | None = None
    """Under ``--heal live``: the group generation this worker joins (0: the first; more: a replacement); None:
    not live-healed."""
    live_store: tuple[str, int] | None = None
    """Under ``--heal live``: (host, port) of the live agent's store (``LIVE_STORE``)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerContext:
        env = os.environ if environ is None else environ
        port = env.get("MASTER_PORT", "")
        return cls(launched_by_ddpkit=launched_by_ddpkit(env), started_at=command_started_at(env),
                   stop_dir=env.get(STOP_DIR) or None, preempted_mark=env.get(PREEMPTED_MARK) or None,
                   result_dir=env.get(RESULT_DIR) or None,
                   restart_count=_int(env.get("TORCHELASTIC_RESTART_COUNT")),
                   max_restarts=_int(env.get("TORCHELASTIC_MAX_RESTARTS")),
                   run_id=env.get("TORCHELASTIC_RUN_ID") or "run", master_addr=env.get("MASTER_ADDR") or None,
                   master_port=int(port) if port.isdigit() else None,
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true",
                   error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
                   heal_silent_s=_seconds(env.get(HEAL_SILENT_S)),
                   live_gen=int(env[LIVE_GEN]) if env.get(LIVE_GEN, "").isdigit() else None,
                   live_store=_endpoint(env.get(LIVE_STORE)))

    @property
    def restartable(self) -> bool:
        """Whether the elastic agent will restart the group once more after this attempt fails."""
        return self.restart_count < self.max_restarts

    @property
    def master(self) -> tuple[str, int] | None:
        """(host, port) of the workers' store, or None when the launcher named none."""
        if self.master_addr is None or self.master_port is None:
            return None
        return self.master_addr, self.master_port
