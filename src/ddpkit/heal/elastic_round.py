"""One host's record of a healed run across hosts (``heal.elastic``): its rounds, each failed one classified from
what its own ranks left (torch's failed workers, the watch's abort orders, under ``ddpkit run`` their tracebacks)
and concluded by the one attempt loop (``heal.attempts``), and the run's exclusion list in the rendezvous store."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.base.errors import EXIT_MISSING, DdpkitError
from ddpkit.base.jsonlines import JsonFields
from ddpkit.base.log import get_logger
from ddpkit.goodput.records import ATTEMPT_VAR
from ddpkit.heal.attempts import Adapter, Attempts, Ended
from ddpkit.heal.classify import Classification, Evidence, FailureClass, WatchReport
from ddpkit.heal.evidence import rank_ended
from ddpkit.heal.lines import Style, say
from ddpkit.heal.policy import HealPolicy
from ddpkit.heal.request import HealRequest
from ddpkit.launch.failure import logged_failure
from ddpkit.launcher_output import Ending
from ddpkit.launcher_output.tracebacks import exception_line
from ddpkit.launcher_output.words import signal_number
from ddpkit.process.stopping import take_abort_orders
from ddpkit.process.worker_context import STOP_DIR
from ddpkit.rundir.ledger import Action, AttemptEnded, AttemptStarted, HostExcluded, Ledger

__all__ = ["EXIT_HOST_EXCLUDED", "Excluded", "ExcludedFromRun", "ExclusionList", "HealRun",
           "HealStopped"]

log = get_logger(__name__)

#: An agent whose host the run excluded leaves with this code: the job goes on without it; do not start it again
#: on this host for this run (README's exit code table).
EXIT_HOST_EXCLUDED = 95
_KEY = "ddpkit-heal/excluded"


@dataclass(frozen=True, kw_only=True)
class Excluded(JsonFields):
    """A host kept out of the run's later rounds: one record of the exclusion list in the rendezvous store."""

    host: str
    reason: str
    """The failure that named it, cause first."""
    by: str
    """The host whose agent excluded it."""
    time: float


class ExcludedFromRun(DdpkitError):
    """This host's agent was excluded from the run: it leaves, the job goes on on the other hosts."""

    exit_code = EXIT_HOST_EXCLUDED


class HealStopped(DdpkitError):
    """The policy ended the run on this host (do not requeue, or no attempt left)."""

    def __init__(self, line: str, code: int) -> None:
        self.exit_code = code
        super().__init__(line)


class ExclusionList:
    """The run's excluded hosts in a store (torch's ``Store``: ``add``, ``set``, ``get``, ``check``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def read(self) -> list[Excluded]:
        count = int(self.store.add(f"{_KEY}/n", 0))
        found = []
        for i in range(1, count + 1):
            key = f"{_KEY}/{i}"
            if self.store.check([key]):  # numbered before it is written: a record being added is read next time
                found.append(Excluded.from_json(bytes(self.store.get(key))))
        return found

    def add(self, entry: Excluded) -> bool:
        """Add ``entry`` unless its host is there already; True when added."""
        if any(e.host == entry.host for e in self.read()):
            return False
        i = int(self.store.add(f"{_KEY}/n", 1))
        self.store.set(f"{_KEY}/{i}", entry.to_json())
        return True


class _TorchFailures:
    """The workers torch's agent saw fail (exit code, local rank, pid), from its log records (their exception or
    arguments: ``launch.failure.logged_failure``, never their text). A filter on torch's logger, added before the
    agent's own (``launch.failure.drop_exit_tracebacks`` drops these lines, and a logger's filters run before its
    handlers); it keeps every record."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def __call__(self, record: logging.LogRecord) -> bool:
        self.note(record)
        return True

    def note(self, record: logging.LogRecord) -> None:
        failed = logged_failure(record)
        if failed is not None:
            local, pid, code = failed
            self.seen.append((code, local, pid))


class HealRun:
    """One host's side of a healed run: its ledger, the policy, and what its rounds left."""

    def __init__(self, request: HealRequest, *, host: str, run_dir: Path, nproc: int, policy: HealPolicy,
                 log_dir: Path | None, progress: Callable[[str | None], int | None]) -> None:
        self.request, self.host, self.run_dir, self.nproc, self.policy = request, host, run_dir, nproc, policy
        self.progress = progress
        self.log_dir = log_dir
        self.ledger = Ledger(run_dir)
        self.attempts = Attempts(ledger=self.ledger, policy=policy, style=Style.RENDEZVOUS, here=host)
        self.failures = _TorchFailures()
        self.rounds = 0
        self.failed_rounds = 0
        self.attempt: int | None = None
        self.node_rank: int | None = None
        self.nodes = 1
        """The hosts of the last round."""

    # -- the rounds ---------------------------------------------------------------------------------------------
    def round_ended(self, exclusions: ExclusionList) -> None:
        """Before this agent joins a round after one it took part in: classify, record and decide. Raises
        HealStopped where the policy ends the run."""
        if self.attempt is None:
            return
        failed, self.failures.seen = self.failures.seen, []
        orders = _orders()
        if not failed and not orders:  # a membership change (another agent joined or left): not a failure here
            say(f"ddpkit heal: {self.host}: the hosts in the job changed; joining the next round")
            return
        self.failed_rounds += 1
        evidence = self._evidence(failed, orders)
        conclusion = self.attempts.conclude(self.attempt, self.failed_rounds,
                                            Ended(exit_code=evidence.exit_code, evidence=evidence),
                                            progress=self.progress(self.request.progress_path),
                                            adapter=_Rendezvous(self, exclusions), quiet=True)
        self.attempt = None
        decision = conclusion.decision
        if decision.action is not Action.RETRY:
            raise HealStopped(conclusion.line, int(decision.exit_code if decision.exit_code is not None
                                                   else evidence.exit_code))
        say(conclusion.line)

    def round_started(self, rank: int, world_size: int) -> None:
        self.rounds += 1
        self.node_rank, self.nodes = rank, world_size
        if self.attempt is None:  # else the membership changed: the same attempt goes on with other hosts
            self.attempt = self.ledger.next_attempt()
            self.ledger.append(AttemptStarted(attempt=self.attempt, time=time.time(), hosts=(self.host,),
                                              ranks=world_size * self.nproc,
                                              logs=str(self.log_dir) if self.log_dir else None))
        os.environ[ATTEMPT_VAR] = str(self.attempt)  # the workers are started after this: train's goodput lines
        say(f"ddpkit heal: {self.host} joined as node {rank} of {world_size} ({world_size * self.nproc} ranks): "
            f"attempt {self.attempt} in its ledger")

    def released(self) -> None:
        say(f"ddpkit heal: {self.host} waited as a spare and the run ended without needing it (exit 0)")

    def leaving(self, entry: Excluded, line: str) -> None:
        """This host was excluded: its open attempt ends in the ledger with the exclusion."""
        found = Classification(kind=FailureClass.HOST, reason=entry.reason, culprit_hosts=(entry.host,),
                               evidence=(f"excluded by {entry.by}",))
        self.ledger.append(AttemptEnded(attempt=self.attempt or self.ledger.next_attempt(), time=time.time(),
                                        exit_code=EXIT_HOST_EXCLUDED, action=Action.STOP, classification=found,
                                        decision=line, exit_code_of_run=EXIT_HOST_EXCLUDED))
        self.attempt = None

    def finished(self, code: int) -> None:
        """The agent returned: the last round's end (success, or torch's restarts spent)."""
        if self.attempt is None:
            return
        ended = Ended(exit_code=code, evidence=None if code == 0 else self._evidence(self.failures.seen, _orders(),
                                                                                       code))
        conclusion = self.attempts.conclude(self.attempt, self.failed_rounds + 1, ended,
                                            progress=self.progress(self.request.progress_path), quiet=True, last=True)
        if code or self.failed_rounds:
            say(conclusion.line)

    # -- evidence -------------------------------------------------------------------------------------------------
    def _evidence(self, failed: list[tuple[int, int, int]], orders: list[Any], code: int | None = None) -> Evidence:
        base = (self.node_rank or 0) * self.nproc
        tails = _stderr_tails(self.log_dir)
        ranks = []
        for i, (exitcode, local, _pid) in enumerate(failed):
            rank = base + local
            ranks.append(rank_ended(rank, self.host, Ending.from_code(exitcode), first=i == 0,
                                    stopped_by_ddpkit=exitcode == EXIT_MISSING,
                                    exception=exception_line(tails.get(rank, ""))))
        stopped: dict[int, str] = {}
        lines = []
        for order in orders:
            lines.append(order.headline)
            for gone in order.stopped:
                stopped[gone.rank] = gone.host
            for r in order.silent or ():
                if r in order.hosts:
                    stopped.setdefault(r, order.hosts[r])
        watch = WatchReport(stopped_answering=tuple(sorted(stopped.items())), lines=tuple(lines)[:5]) \
            if lines else None
        exit_code = code if code is not None else next((r.exit_code or 128 + (signal_number(r.signal) or 0)
                                                        for r in ranks), EXIT_MISSING)
        return Evidence(exit_code=exit_code or EXIT_MISSING, ranks=tuple(ranks), watch=watch)

    def _exclude(self, found: Classification, exclusions: ExclusionList) -> list[str]:
        """The hosts a host-class failure named, added to the run's exclusion list (by this agent, or already by
        another): those in the list."""
        if found.kind is not FailureClass.HOST or not found.culprit_hosts:
            return []
        named = []
        for host in found.culprit_hosts:
            try:
                if exclusions.add(Excluded(host=host, reason=found.reason, by=self.host, time=time.time())):
                    self.ledger.append(HostExcluded(attempt=self.attempt or 0, time=time.time(), host=host,
                                                    reason=found.reason))
                named.append(host)
            except Exception as exc:  # the store is gone with its host: the next round fails on its own
                log.warning("could not add %s to the run's exclusion list: %s", host, exc)
        return named


class _Rendezvous(Adapter):
    """torch elastic's hosts: a host fault's culprits go into the run's exclusion list in the rendezvous store."""

    style = Style.RENDEZVOUS

    def __init__(self, run: HealRun, exclusions: ExclusionList) -> None:
        self.run, self.exclusions = run, exclusions

    def take_out(self, attempts: Attempts, attempt: int, found: Classification) -> tuple[tuple[str, ...], bool]:
        return tuple(self.run._exclude(found, self.exclusions)), False


def _orders() -> list[Any]:
    from ddpkit.watch.records import AbortOrder

    stop_dir = os.environ.get(STOP_DIR)
    return [AbortOrder.from_json(text) for text in take_abort_orders(stop_dir)] if stop_dir else []


def _stderr_tails(log_dir: Path | None) -> dict[int, str]:
    """rank -> the end of its stderr log in the newest attempt directory the agent wrote (ddpkit run only)."""
    if log_dir is None:
        return {}
    attempts = sorted(log_dir.glob("attempt-*"), key=lambda p: p.stat().st_mtime)
    out: dict[int, str] = {}
    for path in sorted(attempts[-1].glob("rank-*.stderr.log")) if attempts else ():
        rank = path.name.removeprefix("rank-").removesuffix(".stderr.log")
        if rank.isdigit():
            try:
                with open(path, "rb") as f:
                    f.seek(max(0, path.stat().st_size - 64 * 1024))
                    out[int(rank)] = f.read().decode(errors="replace")
            except OSError:
                continue
    return out
