"""A rank as the live agent (``live.agent.rules``) sees it: its process (``Proc``, one per spawner: a local process
context, an srun step), what the agent notes of it (``Rank``), and the variables it starts with (``rank_env``)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Protocol

from ddpkit.process.worker_context import LIVE_GEN, LIVE_STORE

__all__ = ["Proc", "Rank", "rank_env"]


class Proc(Protocol):
    """One rank's process as the agent sees it: a local process context (``launch_live``), an srun step on another
    host (``ddpkit.live.agent.slurm``)."""

    host: str
    stopped_word: str
    """How a person reads ``look``'s ``T``: ``stopped (SIGSTOP)`` where the kernel says so."""
    unseen_s: float
    """How long a rank was stopped before ``look`` can say ``T`` (0 where the kernel says it at once)."""

    @property
    def pid(self) -> int: ...

    def wait(self) -> int | None:
        """None while it runs; once it ended, its exit code (negative: the signal that killed it)."""

    def look(self) -> tuple[str, int]:
        """Its state (``T``: stopped) and a count that moves while it works (CPU ticks)."""

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
