"""One attempt loop for every backend: start -> typed result -> classify -> decide -> record -> exclude -> say.

A backend is an adapter (``Adapter``): it starts one attempt on the hosts it is given and returns how it ended as
values (``Ended``: the exit code and the evidence; ``heal.classify``). Everything after that happens here, once,
so that every backend decides, records and speaks alike:

    hosts     the pool's next set (``NodePool.take``), proven by the adapter (``prepare``: Slurm's preflight);
              none left: the adapter's end (``no_hosts``: requeue, or exit 94)
    record    ``AttemptStarted``
    start     ``adapter.start(attempt, hosts, heard)`` -> ``Ended`` (an exception out of it: ``AttemptEnded`` STOP,
              raised on); ``heard``: the attempt's live heals, each recorded (its lost host out where it moved)
    classify  ``classify(ended.evidence)`` where the attempt failed
    decide    ``policy.decide`` (retry, stop, give up; the run's exit code)
    exclude   on a retry after a host fault: the culprit hosts out (``adapter.exclude``: out of the pool, drained,
              kept out by the scheduler), each a ``HostExcluded``
    say       the one line (``heal.lines``: its one author and speaker), to stderr; ``AttemptEnded`` with it

``ddpkit.heal.k8s`` and ``ddpkit.heal.elastic`` do not start their attempts (the operator and torch's agent do):
they call ``Attempts.conclude`` when one has ended, the same classify -> decide -> exclude -> say -> record.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace

from ddpkit.heal.classify import Evidence, classify
from ddpkit.heal.lines import Placement, Style, agent_failed, say, sentence
from ddpkit.heal.nodepool import NodePool
from ddpkit.heal.policy import Decision, HealPolicy, Outcome, decide
from ddpkit.rundir.ledger import (
    Action,
    AttemptEnded,
    AttemptStarted,
    HostExcluded,
    Ledger,
    LiveHook,
    RankReplaced,
    ReplicasDiverged,
)
from ddpkit.rundir.verdict import Classification, FailureClass

__all__ = ["EXIT_NO_HOSTS", "Adapter", "Attempts", "Conclusion", "Ended", "LiveHook"]

#: Fewer healthy hosts are left than the job needs (``-j MIN:N``'s MIN) and the job cannot requeue itself: no
#: attempt can run. One code for every backend (mpirun's ``--hosts``, Slurm's allocation).
EXIT_NO_HOSTS = 94


@dataclass(frozen=True, kw_only=True)
class Ended:
    """How one attempt ended, as its adapter saw it."""

    exit_code: int
    evidence: Evidence | None = None
    """What the failed attempt left, as values; None where it succeeded or nothing was gathered (the attempt is then
    recorded with its exit code and no classification)."""


@dataclass(frozen=True, kw_only=True)
class Conclusion:
    decision: Decision
    line: str
    """The decision as said (``heal.lines.sentence``), and as the ledger records it."""
    found: Classification | None
    excluded: tuple[str, ...] = ()
    """The hosts this attempt's failure took out."""


class Adapter:
    """A backend: how it starts an attempt, and what it does around one. ``start`` is its own; the rest are no-ops
    unless the backend needs them."""

    style: Style = Style.ONE_HOST
    live_moves_host: bool = False
    """Under ``--heal live``, a lost rank's replacement runs on another host (Slurm's standby): the lost host is taken
    out (``take_out``) as a host fault's culprit is."""

    def start(self, attempt: int, of_session: int, hosts: tuple[str, ...], heard: LiveHook) -> Ended:
        """Run the attempt; ``heard``: where its live heals are told, once each (``Attempts.live_healed``)."""
        raise NotImplementedError

    def progress(self) -> int | None:
        """The run's progress after an attempt: the newest snapshot's step (None: not known)."""
        return None

    def logs(self, attempt: int) -> str | None:
        """Where the attempt's per-rank logs are kept (the ledger's ``AttemptStarted.logs``); None: not kept."""
        return None

    def prepare(self, attempt: int, hosts: tuple[str, ...]) -> tuple[str, ...] | None:
        """The hosts proven for the next attempt (Slurm's preflight after a host fault); None: too few left."""
        return hosts

    def take_out(self, attempts: Attempts, attempt: int, found: Classification) -> tuple[tuple[str, ...], bool]:
        """The host fault's culprits out (``Attempts.take_out``: of the pool, or those not out already): the hosts
        named, and whether they were drained. torch elastic's hosts keep their own list (the rendezvous store)."""
        return attempts.take_out(attempt, found, self)

    def drain(self, attempt: int, host: str, reason: str) -> bool:
        """Keep ``host`` out beyond the pool (Slurm's ``--on-fail drain``); True where it was drained."""
        return False

    def excluded(self, found: Classification, going_on: bool) -> None:
        """After a host fault took hosts out (Slurm: give them back to the scheduler)."""

    def no_hosts(self, of_session: int) -> int:
        """Too few healthy hosts for another attempt: say so and return the run's exit code."""
        return EXIT_NO_HOSTS

    def ended(self, conclusion: Conclusion) -> None:
        """After the decision was recorded, before it is said (Slurm: the first failure's traceback, where the run
        ends: the cause where a person looks)."""


@dataclass(kw_only=True)
class Attempts:
    """The run's attempts as one ledger records them, and what is decided after each."""

    ledger: Ledger
    policy: HealPolicy
    style: Style = Style.ONE_HOST
    pool: NodePool | None = None
    """The hosts attempts may use (mpirun's ``--hosts``, Slurm's allocation); None: the backend places them."""
    here: str = ""
    """This host (``Style.RENDEZVOUS``: the one that rejoins)."""

    def started(self, attempt: int, hosts: tuple[str, ...], ranks: int, logs: str | None = None,
                at: float | None = None) -> None:
        self.ledger.append(AttemptStarted(attempt=attempt, time=time.time() if at is None else at, hosts=hosts,
                                          ranks=ranks, logs=logs))

    def conclude(self, attempt: int, of_session: int, ended: Ended, *, progress: int | None = None,
                 adapter: Adapter | None = None, quiet: bool = False, last: bool = False) -> Conclusion:
        """Classify, decide, exclude, say and record the end of ``attempt``; ``quiet``: the caller says the line
        (torch elastic raises it to end the run); ``last``: no other attempt can follow (torch elastic's agent
        has spent its restarts), so a retry becomes giving up."""
        found = classify(ended.evidence) if ended.exit_code and ended.evidence is not None else None
        decision = decide(self.policy, self.ledger.ended(), Outcome(attempt=attempt, of_session=of_session,
                                                                    exit_code=ended.exit_code,
                                                                    classification=found, progress=progress),
                          last=last)
        excluded: tuple[str, ...] = ()
        placed = None
        if decision.action is Action.RETRY and found is not None:
            drained = False
            if found.kind is FailureClass.HOST:
                excluded, drained = (adapter or Adapter()).take_out(self, attempt, found)
            hosts = self.pool.take() if self.pool is not None else ()
            if adapter is not None and found.kind is FailureClass.HOST:
                adapter.excluded(found, hosts is not None)
            placed = Placement(excluded=excluded, drained=drained, hosts=hosts, here=self.here,
                               least=self.pool.least if self.pool else 0, want=self.pool.want if self.pool else 0)
        line = sentence(self.style, decision, found, of_session=of_session, max_attempts=self.policy.max_attempts,
                        exit_code=ended.exit_code, progress=progress, placed=placed)
        if not quiet and (found is not None or of_session > 1):  # a first clean attempt needs no word
            say(line)
        self.ledger.append(AttemptEnded(attempt=attempt, time=time.time(), exit_code=ended.exit_code,
                                        action=decision.action, classification=found, progress=progress,
                                        decision=line,
                                        # the agent that spent its restarts ends with the round's own code
                                        exit_code_of_run=ended.exit_code if last else decision.exit_code))
        return Conclusion(decision=decision, line=line, found=found, excluded=excluded)

    def take_out(self, attempt: int, found: Classification, adapter: Adapter) -> tuple[tuple[str, ...], bool]:
        """The culprit hosts out (of the pool, where there is one; else those not out already), each recorded."""
        out = []
        drained = False
        before = {r.host for r in self.ledger.records() if isinstance(r, HostExcluded)}
        for host in found.culprit_hosts:
            new = self.pool.exclude(host, found.reason) if self.pool is not None else host not in before
            if not new:
                continue
            was = adapter.drain(attempt, host, found.reason)
            drained = drained or was
            self.ledger.append(HostExcluded(attempt=attempt, time=time.time(), host=host, reason=found.reason,
                                            drained=was))
            out.append(host)
        return tuple(out), drained

    def live_healed(self, attempt: int, record: RankReplaced | ReplicasDiverged, *, adapter: Adapter) -> None:
        """A live heal within ``attempt`` (or its replicas found to differ): recorded; where the backend moved the
        rank to another host, the lost host taken out through ``take_out``, as a host fault's culprit is."""
        self.ledger.append(replace(record, attempt=attempt))
        if not isinstance(record, RankReplaced) or not adapter.live_moves_host:
            return
        found = Classification(kind=FailureClass.HOST, reason=f"rank {record.rank} lost ({record.why}); replaced "
                               f"live on {record.replacement_host}", culprit_ranks=(record.rank,),
                               culprit_hosts=(record.host,))
        excluded, _ = adapter.take_out(self, attempt, found)
        if excluded:
            adapter.excluded(found, True)

    def run(self, adapter: Adapter, *, ranks_per_host: int) -> int:
        """Attempts until one succeeds or the policy stops; the run's exit code."""
        for of_session in range(1, self.policy.max_attempts + 1):
            attempt = self.ledger.next_attempt()
            hosts = self.pool.take() if self.pool is not None else (self.here,)
            if hosts is not None:
                hosts = adapter.prepare(attempt, hosts)
            if hosts is None:
                return adapter.no_hosts(of_session)
            self.started(attempt, hosts, len(hosts) * ranks_per_host, logs=adapter.logs(attempt))
            try:
                ended = adapter.start(attempt, of_session, hosts,
                                      functools.partial(self.live_healed, attempt, adapter=adapter))
            except BaseException as exc:  # the agent itself failed, or a signal came before it stopped its ranks
                code = exit_code_of(exc)
                self.ledger.append(AttemptEnded(attempt=attempt, time=time.time(), exit_code=code,
                                                action=Action.STOP, exit_code_of_run=code,
                                                decision=agent_failed(of_session, exc)))
                raise
            conclusion = self.conclude(attempt, of_session, ended, progress=adapter.progress(), adapter=adapter,
                                       quiet=True)
            adapter.ended(conclusion)  # (Slurm: the first failure's traceback, right before the line)
            decision = conclusion.decision
            if conclusion.found is not None or of_session > 1:  # a first clean attempt needs no word
                say(conclusion.line)
            if decision.action is not Action.RETRY:
                return int(decision.exit_code if decision.exit_code is not None else ended.exit_code)
        raise AssertionError("the policy gives up at --max-attempts")  # decide() never retries the last attempt


def exit_code_of(exc: BaseException) -> int:
    """The exit code an exception out of an attempt leaves the process with (torch's SignalException: 128 + the
    signal, as a process that signal ends)."""
    from ddpkit.base.errors import DdpkitError

    if isinstance(exc, DdpkitError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    sigval = getattr(exc, "sigval", None)
    return 128 + int(sigval) if sigval is not None else 1
