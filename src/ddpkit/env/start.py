"""What a command running on a rank is handed by ``ddpkit.lifecycle.run_rank``: read once, before it runs."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.env.record import WorldInfo
from ddpkit.process.worker_context import WorkerContext

__all__ = ["RankStart"]


@dataclass(frozen=True)
class RankStart:
    """The world and the worker's context, read once per process."""

    world: WorldInfo
    """The launcher's record: rank, local rank, world size, node, master, and where each value came from."""
    context: WorkerContext
    """How this worker was started: by ddpkit's agent or torch's, its restart count, the stop protocol's paths."""
