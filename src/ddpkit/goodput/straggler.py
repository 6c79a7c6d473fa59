"""Waiting for a straggler, measured from the ranks' gradient-sync times: pure (no files, no clocks, no torch).

What each rank measures (``train``, through ddpkit's gradient hook, ``comm.gradients``): per step, its *sync
time*, from the moment it handed its last gradient bucket to the all-reduce (its own forward and backward done) to
the moment its backward returned (the all-reduce complete). An all-reduce completes on every rank at about the
same moment, once the last rank has joined; so the rank that joined last (the slowest, the straggler) waits only
for the transfer itself, and a rank that joined earlier waits that plus the difference. Per step:

    straggler wait = max over ranks (sync time) - min over ranks (sync time)

the time the quickest rank sat idle past the slowest one: what the step would be shorter by were the slowest rank
as quick as the quickest. It is the job's time, counted once (not once per waiting rank).

Per ledger line (about a second of steps), each rank's mean sync time per step over rank 0's line's steps (from
its own lines, weighted by the steps they share), so a rank that is slow for a stretch is seen; a straggler that
changes rank from one step to the next averages out and is not. Not measured, so 0: DDP's own C++ all-reduce
(models above ``PYTHON_HOOK_MAX_PARAMS``, where no ddpkit hook runs), one rank, a run whose other ranks wrote no
lines.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddpkit.goodput.records import Steps

__all__ = ["RankWait", "attempt_wait", "mean_sync", "rank_waits", "steps_done", "window_wait"]


def mean_sync(lines: Sequence[Steps], first: int, last: int) -> float | None:
    """A rank's mean sync time per step over steps ``first``..``last`` (its lines of one attempt); None: none of
    its measured lines holds one of those steps."""
    total = shared = 0.0
    for r in lines:
        if r.sync_s is None:
            continue
        overlap = min(r.last, last) - max(r.first, first) + 1
        if overlap > 0:
            total += r.sync_s * overlap / r.count
            shared += overlap
    return total / shared if shared else None


def window_wait(window: Steps, others: Mapping[int, Sequence[Steps]]) -> float:
    """The straggler wait inside rank 0's ``window`` (seconds, over its steps): its steps times the spread of the
    ranks' mean sync per step; ``others``: the other ranks' lines of the same attempt."""
    if window.sync_s is None or not others:
        return 0.0
    means = [window.sync_s / window.count]
    for lines in others.values():
        mean = mean_sync(lines, window.first, window.last)
        if mean is not None:
            means.append(mean)
    if len(means) < 2:
        return 0.0
    return min(window.busy_s, window.count * (max(means) - min(means)))


def attempt_wait(own: Sequence[Steps], others: Mapping[int, Sequence[Steps]]) -> float:
    """The straggler wait over rank 0's lines ``own`` of one attempt: their measured steps times the spread of the
    ranks' mean sync per step over the whole attempt. Each window's spread (``window_wait``) is the spread of means
    of a few sampled steps (``ddpkit run`` samples DDP's own statistic, about one step in a hundred), and the spread
    of noisy means is positive on average even between equal ranks: summed over windows, a healthy 2-rank job on 2
    shared cores showed 10-13% "waiting". Over the attempt the noise averages out and a rank that is really slower,
    for the whole run or for a stretch, still shows; the windows keep their share of it (``accounting``)."""
    means = []
    for lines in (own, *others.values()):
        measured = [r for r in lines if r.sync_s is not None]
        steps = sum(r.count for r in measured)
        if steps:
            means.append(sum(r.sync_s or 0.0 for r in measured) / steps)
    if len(means) < 2:
        return 0.0
    return sum(r.count for r in own if r.sync_s is not None) * (max(means) - min(means))


@dataclass(frozen=True, kw_only=True)
class RankWait:
    """One rank over the run: its steps, median step, time in the gradient sync and, of that, the wait for a slower
    rank (its sync time per step less the least of any rank over the same steps)."""

    rank: int
    steps: int
    busy_s: float
    p50_ms: float
    sync_s: float | None
    wait_s: float | None

    @property
    def wait_share(self) -> float | None:
        """The wait for a slower rank as a share of this rank's time in its steps."""
        return self.wait_s / self.busy_s if self.wait_s is not None and self.busy_s > 0 else None

    @property
    def sync_share(self) -> float | None:
        return self.sync_s / self.busy_s if self.sync_s is not None and self.busy_s > 0 else None


def steps_done(lines: Sequence[Steps]) -> int:
    """A rank's steps over the run, across its processes: per attempt, where its lines number the run's steps (one
    numbering, increasing: ``train``), every step from its first to its last (a process killed under ``--heal live``
    applied the steps of its last unwritten line, which its replacement took on from); where each process numbers
    its own (a user's script), the steps its lines count."""
    total = 0
    for attempt in sorted({r.attempt for r in lines}):
        mine = sorted((r for r in lines if r.attempt == attempt), key=lambda r: r.start)
        if all(b.first > a.last for a, b in itertools.pairwise(mine)):
            total += mine[-1].last - mine[0].first + 1
        else:
            total += sum(r.count for r in mine)
    return total


def rank_waits(rank_steps: Mapping[int, Sequence[Steps]]) -> list[RankWait]:
    """Each rank's figures, by rank: every one of its lines against the least mean sync of any rank (itself
    included) over the line's steps in the same attempt."""
    by_attempt: dict[int, dict[int, list[Steps]]] = {}
    for rank, lines in rank_steps.items():
        for r in lines:
            by_attempt.setdefault(r.attempt, {}).setdefault(rank, []).append(r)
    out = []
    for rank, lines in sorted(rank_steps.items()):
        measured = [r for r in lines if r.sync_s is not None]
        wait: float | None = None
        if measured:
            wait = 0.0
            for r in measured:
                peers = by_attempt[r.attempt]
                means = [m for m in (mean_sync(peer, r.first, r.last) for peer in peers.values()) if m is not None]
                wait += max(0.0, (r.sync_s or 0.0) - r.count * min(means))
        p50s = sorted(r.p50_ms for r in lines)
        out.append(RankWait(rank=rank, steps=steps_done(lines), busy_s=sum(r.busy_s for r in lines),
                            p50_ms=p50s[len(p50s) // 2] if p50s else 0.0,
                            sync_s=sum(r.sync_s or 0.0 for r in measured) if measured else None, wait_s=wait))
    return out
