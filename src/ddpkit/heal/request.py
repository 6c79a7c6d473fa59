"""What ``ddpkit run|train --heal`` asks of the heal wing, as a value the command builds from its arguments: the
heal wing reads no ``argparse.Namespace``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.launch.result import AttemptResult
    from ddpkit.rundir.ledger import LiveHook

    #: The agent, once, as the command starts it: ``(options, live)``; ``live``: the attempt's ``LiveHook`` under
    #: ``--heal live``, else None.
    LaunchAttempt = Callable[[LaunchOptions, LiveHook | None], AttemptResult]

__all__ = ["HealRequest"]


@dataclass(frozen=True, kw_only=True)
class HealRequest:
    command: str
    """``run`` or ``train`` (``HEALED_COMMANDS``); another is refused with a message."""
    max_attempts: int
    run_dir: str | None = None
    """``--run-dir``; None: a new directory under ``.ddpkit-runs`` (across hosts: ``.ddpkit-runs/RUN_ID``)."""
    run_id: str | None = None
    """``--run-id`` (across hosts: the rendezvous' id)."""
    snapshot_path: str | None = None
    """``train --snapshot-path``: where the run's progress (its newest snapshot's step) is read."""
    argv: tuple[str, ...] = ()
    """ddpkit's command line, as given (the ledger's ``SupervisorStarted.command``)."""
    live: bool = False
    """``--heal live``: a lost rank is replaced within the attempt, the others keeping their processes
    (``ddpkit.live.agent.rules``); an attempt that cannot go on live fails, and is healed by a restart."""

    standby: bool = False
    """``--standby`` (``-j NxP --heal live`` across hosts): this host holds no rank at the start; it takes a lost
    host's ranks (``ddpkit.heal.live_hosts``)."""

    @property
    def keeps_rank_logs(self) -> bool:
        """``ddpkit run``'s ranks' output is kept per attempt (their tracebacks are the evidence); train's ranks
        print to the screen."""
        return self.command == "run"

    @property
    def progress_path(self) -> str | None:
        """The snapshot path whose newest step is the run's progress (train's alone: a script's is not known)."""
        return self.snapshot_path if self.command == "train" else None
