"""The nodes of one Slurm allocation as a heal supervisor sees them: which it may use, which are out for good.

Pure: no processes, no Slurm. ``ddpkit submit slurm -j [MIN:]NxP --spare-nodes K --heal`` allocates N+K nodes;
each attempt runs on the first N healthy ones in the allocation's order (the spares are the last K), fewer down to
MIN where the job allows it (``-j MIN:N``); a host found bad is never used again by the job (``exclude``), and a
requeued job starts with the bad hosts its ledger names already out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodePool"]


@dataclass(kw_only=True)
class NodePool:
    allocation: tuple[str, ...]
    """Every node of the allocation, in Slurm's order (``scontrol show hostnames``)."""
    want: int
    """N: the nodes an attempt runs on."""
    least: int
    """MIN: the fewest nodes an attempt may run on (``-j MIN:N``; N for a fixed shape)."""
    bad: dict[str, str] = field(default_factory=dict)
    """Host -> why it is out."""

    def __post_init__(self) -> None:
        if not 1 <= self.least <= self.want:
            raise ValueError(f"least {self.least} and want {self.want}: expected 1 <= least <= want")

    @property
    def healthy(self) -> tuple[str, ...]:
        return tuple(n for n in self.allocation if n not in self.bad)

    @property
    def spares(self) -> int:
        """Healthy nodes beyond the N an attempt wants."""
        return max(0, len(self.healthy) - self.want)

    def exclude(self, host: str, reason: str) -> bool:
        """Take ``host`` out for good; False when it was out already (or is not in this allocation)."""
        if host in self.bad or host not in self.allocation:
            return False
        self.bad[host] = reason
        return True

    def take(self) -> tuple[str, ...] | None:
        """The nodes of the next attempt: the first N healthy ones, or as many as are left down to MIN; None when
        fewer than MIN are left (the job cannot go on in this allocation)."""
        healthy = self.healthy
        if len(healthy) < self.least:
            return None
        return healthy[: self.want]
