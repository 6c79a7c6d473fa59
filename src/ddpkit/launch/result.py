"""What one run of ddpkit's agent left, as values: its exit code, torch's typed per-rank failures, a signal from
outside the job, and the watch's abort orders (which ranks stopped answering, on which hosts) that its workers left
in the agent's stop directory (``ddpkit.process.stopping.leave_abort_order``).

torch elastic's ``RunResult`` is the model: the launcher's outcome is a value, and a heal supervisor classifies the
attempt from it (``ddpkit.heal.supervisor``), not from the lines the agent printed for a person."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

from ddpkit.launch.failure import RankFailure, all_preempted, first_of
from ddpkit.process.stopping import take_abort_orders
from ddpkit.watch.records import AbortOrder

__all__ = ["AttemptResult", "abort_orders", "orders_of"]


@dataclass(frozen=True, kw_only=True)
class AttemptResult:
    """How one run of the agent (one attempt) ended."""

    exit_code: int
    """What ``launch`` returns: 0, the first failed rank's code, 3 where ddpkit stopped the ranks, 128 + a signal."""
    failures: tuple[RankFailure, ...] = ()
    """The ranks torch saw fail, the first to fail first (``launch.failure.rank_failures``)."""
    outside_signal: str | None = None
    """A signal the agent received from outside the job (``SIGTERM`` from a scheduler, ``SIGINT``)."""
    watch_orders: tuple[AbortOrder, ...] = ()
    """The watch's orders that stopped the ranks (exit 3), as the workers left them."""

    @property
    def first(self) -> RankFailure | None:
        """The rank that failed on its own first; None where ddpkit stopped the ranks or they were preempted."""
        return first_of(self.failures)

    @property
    def all_preempted(self) -> bool:
        """Every rank stopped after a preemption signal (75 or 76, the others ended by SIGTERM)."""
        return all_preempted(self.failures)


def abort_orders(stop_dir: str) -> tuple[AbortOrder, ...]:
    """The abort orders the workers left in the agent's stop directory (taken: each is read once)."""
    return orders_of(take_abort_orders(stop_dir))


def orders_of(texts: Iterable[str]) -> tuple[AbortOrder, ...]:
    """The abort orders among ``texts`` (JSON, as workers leave them); one a worker was killed while writing is
    left out."""
    found = []
    for text in texts:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            found.append(AbortOrder.from_json(text))
    return tuple(found)
