"""The evidence of a failed attempt of ddpkit's own agent (one host, Slurm's live agent, the agent across hosts): its
typed result and the ranks' stderr logs it kept, as ``heal.classify`` reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.heal.classify import Evidence, RankEvidence, WatchReport, exception_line
from ddpkit.heal.evidence import watch_of
from ddpkit.launch.ranklogs import file_tail
from ddpkit.launcher_output.ddpkit_lines import silent_ranks

if TYPE_CHECKING:
    from ddpkit.launch.result import AttemptResult

__all__ = ["gather"]


def gather(code: int, result: AttemptResult | None, logs: str | None, host: str,
           hosts: Mapping[int, str] | None = None, tails: Iterable[tuple[int, str]] = ()) -> Evidence:
    """The evidence of a failed attempt: the agent's typed result (None: it gave none) and the ranks' stderr logs
    under ``logs`` (their tracebacks), with ``tails`` (rank, the end of its stderr) read elsewhere (another host's
    member sent them); each rank on ``host``, or on ``hosts[rank]`` where given (Slurm's live agent: a rank an srun
    step on its node)."""
    ranks: dict[int, RankEvidence] = {}
    where = hosts or {}
    first = result.first if result is not None else None
    for failure in result.failures if result is not None else ():
        # SIGTERM on a rank that did not fail first: its agent ended it after another failed (ddpkit's doing, as
        # exit 3 is); on the first, it came from outside
        by_agent = failure.signal == "SIGTERM" and failure is not first
        ranks[failure.rank] = RankEvidence(rank=failure.rank, host=where.get(failure.rank, host), signal=failure.signal,
                                           exit_code=None if failure.signal else failure.exit_code,
                                           stopped_by_ddpkit=failure.stopped_by_ddpkit or by_agent,
                                           first=failure is first)
    tails = [*_stderr_tails(logs), *tails]
    for rank, text in tails:
        said = exception_line(text)
        if said is not None:
            known = ranks.get(rank) or RankEvidence(rank=rank, host=where.get(rank, host))
            ranks[rank] = dataclasses.replace(known, exception=said)
    watch = _watch_report(result, host)
    if watch is None or not watch.stopped_answering:
        watch = _silent_holder_in_logs(tails) or watch
    return Evidence(exit_code=code, ranks=tuple(ranks.values()), watch=watch,
                    outside_signal=result.outside_signal if result is not None else None,
                    all_preempted=result.all_preempted if result is not None else False)


def _watch_report(result: AttemptResult | None, host: str) -> WatchReport | None:
    """The watch's abort orders as its report: the ranks they name as silent (stopped answering), with their hosts."""
    orders = result.watch_orders if result is not None else ()
    if not orders:
        return None
    silent: dict[int, str] = {}
    for order in orders:
        for gone in order.stopped:
            silent[gone.rank] = gone.host
        for rank in order.silent or ():
            silent.setdefault(rank, order.hosts.get(rank, host))
    return WatchReport(stopped_answering=tuple(sorted(silent.items())),
                       hang=any(order.deadline is None for order in orders),
                       lines=tuple(dict.fromkeys(order.headline for order in orders))[:20])


def _silent_holder_in_logs(tails: list[tuple[int, str]]) -> WatchReport | None:
    """The one report that leaves no abort order yet: a rank that lost the job's store names its holder as silent
    only in its output (``watch.storeloss``, "rank 0 on host H (pid P) stopped answering: ..."), read from the rank
    logs under ``ddpkit run``. To go once that report leaves its order as the watch's other stops do."""
    silent = [rank for _, text in tails for line in text.splitlines() for rank in silent_ranks(line)]
    return watch_of(silent, hang=True) if silent else None


def _stderr_tails(logs: str | None) -> Iterator[tuple[int, str]]:
    """(rank, end of its stderr log) for each rank log the agent kept under ``logs`` (any of its attempts)."""
    if not logs:
        return
    for path in sorted(Path(logs).glob("attempt-*/rank-*.stderr.log")):
        rank = path.name.removeprefix("rank-").removesuffix(".stderr.log")
        if not rank.isdigit():
            continue
        yield int(rank), file_tail(path)
