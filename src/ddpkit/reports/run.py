"""A run directory read: the heal ledger's attempts (with their causes) and the goodput ledger, accounted
(``ddpkit.goodput.accounting``). What the HTML page, the trace and the Prometheus textfile show."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.base.errors import ConfigError
from ddpkit.goodput.accounting import AttemptSpan, Split, account
from ddpkit.goodput.records import GoodputRecord, RankStarted, Steps, read_goodput
from ddpkit.rundir import RunDir
from ddpkit.rundir.ledger import AttemptEnded, AttemptStarted, RankReplaced, Record, SupervisorStarted, read_records
from ddpkit.rundir.verdict import FailureClass

__all__ = ["HostAtFault", "RunView", "is_run_dir", "load_run"]


@dataclass(frozen=True, kw_only=True)
class HostAtFault:
    """A host a host-class failure named, and what the supervisor did about it."""

    host: str
    attempt: int
    ranks: tuple[int, ...]
    reason: str
    decision: str


@dataclass(kw_only=True)
class RunView:
    run_dir: Path
    split: Split
    goodput: list[GoodputRecord]
    ledger: list[Record]
    command: tuple[str, ...] = ()
    hosts_at_fault: list[HostAtFault] = field(default_factory=list)
    world_size: int | None = None
    rank_steps: dict[int, list[Steps]] = field(default_factory=dict)
    """Each rank's step lines (rank 0's from the ledger, the others' from ``goodput.rank-R.jsonl``)."""


def is_run_dir(path: Path) -> bool:
    return RunDir(path).holds_a_run()


def attempt_spans(ledger: list[Record]) -> list[AttemptSpan]:
    """Each attempt of the heal ledger: its start, its end (None where none was recorded) and its cause."""
    ended = {r.attempt: r for r in ledger if isinstance(r, AttemptEnded)}
    heals: dict[int, list[tuple[float, float]]] = {}
    for r in ledger:
        if isinstance(r, RankReplaced):
            heals.setdefault(r.attempt, []).append((r.lost_at, r.first_step_at or r.joined_at or r.lost_at))
    spans = []
    for start in (r for r in ledger if isinstance(r, AttemptStarted)):
        end = ended.get(start.attempt)
        found = end.classification if end is not None else None
        spans.append(AttemptSpan(attempt=start.attempt, start=start.time, end=end.time if end else None,
                                 exit_code=end.exit_code if end else None, cause=found.reason if found else "",
                                 failure_class=found.kind.value if found else None, hosts=start.hosts,
                                 heals=tuple(heals.get(start.attempt, ()))))
    return spans


def load_run(run_dir: str | Path, *, window_s: float = 60.0) -> RunView:
    """The run directory's ledgers, accounted; ConfigError where it holds neither."""
    run_dir = Path(run_dir)
    files = RunDir(run_dir)
    ledger, goodput = read_records(files.ledger), read_goodput(files.goodput)
    spans = attempt_spans(ledger)
    if not spans and not any(isinstance(r, RankStarted) for r in goodput):
        raise ConfigError(f"{run_dir} holds no attempt ({files.ledger.name} and {files.goodput.name} are missing or "
                          "empty)",
                          "a run directory of ddpkit train --run-dir DIR, or of ddpkit run|train --heal",
                          "pass the directory that --run-dir named (or .ddpkit-runs/RUN_ID)")
    started = [r for r in ledger if isinstance(r, SupervisorStarted)]
    at_fault = [HostAtFault(host=host, attempt=r.attempt, ranks=r.classification.culprit_ranks,
                            reason=r.classification.reason, decision=r.decision)
                for r in ledger if isinstance(r, AttemptEnded) and r.classification is not None
                and r.classification.kind is FailureClass.HOST for host in r.classification.culprit_hosts]
    sizes = [r.world_size for r in goodput if isinstance(r, RankStarted)]
    rank_steps: dict[int, list[Steps]] = {0: [r for r in goodput if isinstance(r, Steps)]}
    for path in files.rank_goodputs():
        lines = [r for r in read_goodput(path) if isinstance(r, Steps)]
        if lines:
            rank_steps[lines[0].rank] = lines
    split = account(spans, goodput, window_s=window_s, rank_steps=rank_steps)
    return RunView(run_dir=run_dir, split=split, goodput=goodput, ledger=ledger,
                   command=started[-1].command if started else (), hosts_at_fault=at_fault,
                   world_size=sizes[-1] if sizes else None, rank_steps=dict(sorted(rank_steps.items())))
