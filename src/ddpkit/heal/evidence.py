"""The evidence of a failed attempt, from the events its launcher's output states (``ddpkit.launcher_output``: the
reader the digest reads too, so the two cannot disagree): a rank's end, its last traceback, the ranks the watch
says stopped answering. Each backend's ``evidence_of`` says which events count, and how a rank's host is named
(srun's node, mpirun's host list, a pod's node); these are the steps they share. Pure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence

from ddpkit.heal.classify import RankEvidence, WatchReport
from ddpkit.launcher_output import Ending, RankTraceback, SilentRank
from ddpkit.launcher_output.tracebacks import rank_traceback

__all__ = ["rank_ended", "tracebacks_of", "watch_of", "with_exceptions"]


def rank_ended(rank: int, host: str, how: Ending, *, first: bool = False, stopped_by_ddpkit: bool = False,
               exception: str | None = None) -> RankEvidence:
    """A rank's end as evidence: the signal's name where a signal ended it, else its exit code."""
    return RankEvidence(rank=rank, host=host, exit_code=how.exit_code if how.signal is None else None,
                        signal=how.signal_name, first=first, stopped_by_ddpkit=stopped_by_ddpkit, exception=exception)


def tracebacks_of(tails: Mapping[int, Sequence[str]], host_of: Callable[[int], str]) -> list[RankTraceback]:
    """Each rank's last traceback among its own lines (rank -> its lines), ranks in order."""
    found = (rank_traceback(rank, host_of(rank), lines) for rank, lines in sorted(tails.items()))
    return [t for t in found if t is not None]


def with_exceptions(ranks: dict[int, RankEvidence], tracebacks: Iterable[RankTraceback], *,
                    exit_code: int | None = None) -> None:
    """Each rank's exception into ``ranks``; a rank no launcher named failed joins, with ``exit_code``."""
    for said in tracebacks:
        known = ranks.get(said.rank) or RankEvidence(rank=said.rank, host=said.host or "?", exit_code=exit_code)
        ranks[said.rank] = dataclasses.replace(known, exception=said.exception)


def watch_of(silent: Iterable[SilentRank], *, lines: Iterable[str] = (), host_of: Callable[[SilentRank], str]
             | None = None, most: int = 20, hang: bool = False) -> WatchReport:
    """The watch's report: the ranks it says stopped answering, each on its host (as the watch names it, or as
    ``host_of`` says), and its lines as evidence (``lines``, else the lines that name them), the first ``most``."""
    silent = list(silent)
    stopped = {s.rank: host_of(s) if host_of else s.host for s in silent}
    said = list(lines) or [s.line for s in silent]
    return WatchReport(stopped_answering=tuple(sorted(stopped.items())), hang=hang,
                       lines=tuple(dict.fromkeys(said))[:most])
