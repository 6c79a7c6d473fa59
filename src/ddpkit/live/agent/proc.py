"""A rank as the live agent (``live.agent.rules``) sees it: its process (``Proc``, one per spawner: a local process
context, an srun step), what the kernel of its host says of it (``Seen``), what the agent notes of it (``Rank``), and
the variables it starts with (``rank_env``)."""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Protocol

from ddpkit.process.worker_context import LIVE_GEN, LIVE_STORE

__all__ = ["Proc", "Rank", "Seen", "rank_env", "stat_of"]


class Seen(enum.Enum):
    """A running rank's process as its host's kernel says it (``/proc/PID/stat``: read by the agent on one host, by
    the rank's pulse on its node under Slurm, ``live.agent.pulse``). Never a guess from a thread of the rank itself:
    a rank whose Python holds the GIL is RUNNING. Whether it makes progress is the watch's to say (a hung rank,
    ``ddpkit.watch.actions``), by its own rules for healthy pauses."""

    RUNNING = "running"
    WAITING_IO = "waiting-io"
    """The kernel's ``D``: in an uninterruptible wait (disk, a network file system): working, not idle."""
    STOPPED = "stopped (SIGSTOP)"
    """The kernel's ``T``/``t``: stopped by a signal or a debugger."""
    SILENT = "silent (no word from its host)"
    """Under Slurm, or across hosts: no word from the rank's host for ``Proc.silent_s`` (its pulse, or its member's
    beat, stood still: the host, or the step, frozen or cut off)."""

    @classmethod
    def of_state(cls, letter: str) -> Seen:
        """The kernel's one-letter state (``/proc/PID/stat``'s third field)."""
        if letter in ("T", "t"):
            return cls.STOPPED
        return cls.WAITING_IO if letter == "D" else cls.RUNNING

    @property
    def lost(self) -> bool:
        """Lost once it lasts ``STOPPED_S`` while others run."""
        return self in (Seen.STOPPED, Seen.SILENT)


class Proc(Protocol):
    """One rank's process as the agent sees it: a local process context (``launch_live``), an srun step on another
    host (``ddpkit.live.agent.slurm``)."""

    host: str
    silent_s: float
    """How long no word from the rank's host means ``Seen.SILENT`` (0: the agent reads its kernel itself); the
    agent dates a silence back by it, and answers "no loss" only after it."""

    @property
    def pid(self) -> int: ...

    def wait(self) -> int | None:
        """None while it runs; once it ended, its exit code (negative: the signal that killed it)."""

    def look(self) -> tuple[Seen, int]:
        """What its host's kernel says of it, and a count that moves while it works (its CPU ticks; -1: not
        known)."""

    def heard_since(self, since: float) -> bool:
        """Its host said it runs (not gone) after ``since`` (``time.monotonic``): on one host the kernel read now,
        under Slurm a pulse that came after it."""

    def send(self, sig: signal.Signals) -> None: ...

    def close(self) -> None: ...


@dataclass(kw_only=True)
class Rank:
    rank: int
    env: dict[str, str]
    proc: Proc
    stopped_since: float | None = None
    ended_by_agent: str | None = None
    """Why the agent killed it (``stopped (SIGSTOP)``), or None."""
    done: bool = False
    ticks: int = -1
    """Its CPU time (clock ticks) when last looked at, once another rank finished."""
    idle_since: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


def rank_env(rank: int, world: int, *, address: str, port: int, run_id: str, per_host: int | None = None,
             group_rank: int = 0) -> dict[str, str]:
    """Rank ``rank``'s variables, as torchrun's agent gives them (``per_host``: ranks on its host, all by default),
    and live healing's: generation 0, the agent's store at ``address:port``."""
    local = world if per_host is None else per_host
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % local), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(world // local),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "ROLE_NAME": "default", "MASTER_ADDR": address,
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True", LIVE_GEN: "0",
            LIVE_STORE: f"{address}:{port}"}


def stat_of(pid: int) -> tuple[str, int]:
    """The kernel's one-letter state of ``pid`` (R, S, D, T...) and the CPU time it used, all its threads, in clock
    ticks (utime + stime); ("", -1) where it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return "", -1
