"""Where an attempt's steps lie in the run's training, so that a step done again is told from a new one: pure.

``train`` numbers its steps across attempts (a resumed attempt goes on from its snapshot's step): a step's number
is its position. A user's script under ``ddpkit run`` is counted from 1 in every attempt (the watch counts its DDP
forwards and cannot see its checkpoint), so its numbers say nothing of where it resumed. The evidence that holds
for the common scripts is the epoch: a script with a ``DistributedSampler`` calls ``set_epoch(e)`` as each epoch
begins (pytorch/examples' DDP tutorials, the seeds' ``ddp.py``), and a script that resumes from its checkpoint
starts its loop at the epoch it saved. With an epoch's length in steps, seen in any attempt (the steps from
``set_epoch(e)`` to ``set_epoch(e + 1)``), step ``s`` after the mark ``(e, at)`` lies at ``e * length + s - at + 1``.

The rules, for a run whose steps are numbered per attempt:

============================================  ==========================================================
the attempt                                   its positions
============================================  ==========================================================
a mark at or before its first step, and the   known: each step from its last mark
length known (or one epoch in the whole run)
no mark, and it loaded no saved state before  known: it began from the start, step ``s`` at ``s`` (a script
its first step (``RankStarted.loaded_state``) that keeps no checkpoint does everything again)
anything else                                 not known: its steps done again are "not known", never a
                                              guess (and every later attempt's too: the furthest point
                                              reached is not known)
============================================  ==========================================================

The first attempt that made steps has nothing before it: it did nothing again, placed or not, unless an attempt
before it ran and left no step lines (killed before its rank 0's first line): what that one did is not known, so
the steps done again are not known either (``accounting``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.goodput.records import EpochBegan, GoodputRecord, RankStarted, Steps

__all__ = ["GLOBAL", "Placement", "epoch_length", "numbered_per_attempt", "place"]


@dataclass(frozen=True)
class Placement:
    """An attempt's steps on the run's axis: ``segments`` of (first step of the segment, its position), sorted by
    step; each step after a segment's first lies one position further, up to the next segment."""

    segments: tuple[tuple[int, int], ...]

    def _pieces(self, first: int, last: int) -> list[tuple[int, int]]:
        """(position of the piece's first step, of its last) for the steps ``first..last``."""
        out = []
        for i, (start, position) in enumerate(self.segments):
            end = self.segments[i + 1][0] - 1 if i + 1 < len(self.segments) else last
            lo, hi = max(first, start), min(last, end)
            if lo <= hi:
                out.append((position + lo - start, position + hi - start))
        return out

    def done_again(self, first: int, last: int, furthest: int) -> int:
        """How many of the steps ``first..last`` lie at or below ``furthest`` (done by an earlier attempt)."""
        return sum(max(0, min(hi, furthest) - lo + 1) for lo, hi in self._pieces(first, last))

    def reached(self, first: int, last: int) -> int:
        """The furthest position among the steps ``first..last`` (0: none)."""
        return max((hi for _, hi in self._pieces(first, last)), default=0)


#: ``train``'s steps: the number is the position; a script that began from the start: the same.
GLOBAL = FROM_THE_START = Placement(((0, 0),))


def numbered_per_attempt(records: Sequence[GoodputRecord]) -> bool:
    """Whether the attempt's steps count from 1 (``ddpkit run``'s), per its rank 0's ``RankStarted``."""
    return any(isinstance(r, RankStarted) and r.numbering == "attempt" for r in records)


def _marks(records: Sequence[GoodputRecord]) -> list[EpochBegan]:
    return sorted((r for r in records if isinstance(r, EpochBegan)), key=lambda r: r.step)


def epoch_length(records: Sequence[GoodputRecord]) -> int | None:
    """The steps of one epoch, the most common among consecutive epochs of any attempt; None: no whole epoch seen."""
    lengths: Counter[int] = Counter()
    by_attempt: dict[int, list[EpochBegan]] = {}
    for mark in _marks(records):
        by_attempt.setdefault(mark.attempt, []).append(mark)
    for marks in by_attempt.values():
        for a, b in itertools.pairwise(marks):
            if b.epoch == a.epoch + 1 and b.step > a.step:
                lengths[b.step - a.step] += 1
    return lengths.most_common(1)[0][0] if lengths else None


def place(records: Sequence[GoodputRecord], steps: Sequence[Steps], length: int | None,
          one_epoch: bool) -> Placement | None:
    """The attempt's placement (its ``records``, its ``steps``); None where it cannot be known (the table above).
    ``length``: ``epoch_length`` of the whole run; ``one_epoch``: every mark of the run is of one epoch."""
    if not numbered_per_attempt(records):
        return GLOBAL
    marks = _marks(records)
    if not steps:
        return None
    if not marks or marks[0].step > min(r.first for r in steps):
        fresh = any(isinstance(r, RankStarted) and r.loaded_state is False for r in records)
        return FROM_THE_START if fresh and not marks else None
    if length is None and not one_epoch:
        return None
    per_epoch = length or 0
    return Placement(tuple((m.step, m.epoch * per_epoch + 1) for m in marks))
