"""One classification of a failed attempt, from the evidence ddpkit has: what each failed rank left (exit code or
signal, whether ddpkit stopped it, its last exception), the watch's report, a signal from outside the job.

Pure: records in, a record out; no torch, no processes. The supervisor (``ddpkit.heal.supervisor``) gathers the
evidence on one host; the other backends (Slurm, torchrun across hosts, mpirun, Kubernetes) will gather the same
records from their own agents and share these rules.

The rules, in order (the first that holds decides)::

    a signal from outside the job reached the agent, or the ranks left 75/76        -> preempted
    the watch names ranks that stopped answering                                   -> host   (those ranks)
    the first rank that failed on its own got SIGTERM (not from its agent)          -> preempted
    ... was killed by another signal (SIGKILL, SIGSEGV, SIGBUS)                     -> host   (those ranks)
    ... raised a Python exception that is not a peer's failure                      -> job    (ranks with that one)
    ... exited with a code and left no traceback                                    -> unknown
    no rank failed on its own, and some lost a peer (gloo's "closed by peer")       -> host   (cut off)
    anything else (ddpkit stopped the ranks and nothing says why)                   -> unknown

A rank "failed on its own" when ddpkit did not stop it (exit 3: the watch's abort; SIGTERM: its agent ending the
survivors) and its exception is not a peer's failure (``ddpkit.process.exiting.PEER_GONE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.base.errors import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.launcher_output.tracebacks import exception_line
from ddpkit.launcher_output.words import rank_list
from ddpkit.process.exiting import PEER_GONE
from ddpkit.rundir.verdict import Classification, FailureClass

__all__ = ["Classification", "Evidence", "FailureClass", "RankEvidence", "WatchReport", "classify", "exception_line"]

_PREEMPTED_CODES = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)


@dataclass(frozen=True, kw_only=True)
class RankEvidence:
    """What one failed rank of the attempt left."""

    rank: int
    host: str
    exit_code: int | None = None
    """Its exit code, where it exited (not killed) and the agent reported it."""
    signal: str | None = None
    """The signal that killed it (``SIGKILL``), where one did."""
    stopped_by_ddpkit: bool = False
    """ddpkit ended it: exit 3 (the watch's abort, a deadline) or SIGTERM from its own agent after another failed."""
    exception: str | None = None
    """The last line of its last Python traceback (``KeyError: 'batch'``), where it printed one."""
    first: bool = False
    """The rank the agent named as the one that failed first."""

    @property
    def peer_failure(self) -> bool:
        """Its exception is a collective's failure because a peer is gone (``ddpkit.process.exiting.PEER_GONE``)."""
        return self.exception is not None and any(words in self.exception for words in PEER_GONE)

    @property
    def on_its_own(self) -> bool:
        return not self.stopped_by_ddpkit and not self.peer_failure

    def said(self) -> str:
        """``rank 1 on host vm: killed by SIGKILL``: one evidence line."""
        parts = []
        if self.signal:
            parts.append(f"killed by {self.signal}")
        elif self.exit_code is not None:
            parts.append(f"exit code {self.exit_code}")
        if self.stopped_by_ddpkit:
            parts.append("stopped by ddpkit")
        if self.exception:
            parts.append(self.exception + (" (a peer's failure)" if self.peer_failure else ""))
        if self.first:
            parts.append("failed first")
        return f"rank {self.rank} on host {self.host}: {'; '.join(parts) or 'failed'}"


@dataclass(frozen=True, kw_only=True)
class WatchReport:
    """The watch's report of the attempt, where one was printed."""

    stopped_answering: tuple[tuple[int, str], ...] = ()
    """(rank, host) of each rank the watch says stopped answering (no heartbeat: stopped, killed, host lost)."""
    hang: bool = False
    """The watch reported a hang (and stopped the ranks: exit 3)."""
    lines: tuple[str, ...] = ()
    """Its lines, as evidence."""


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """Everything known about one failed attempt."""

    exit_code: int
    """The attempt's exit code, as the agent returned it."""
    ranks: tuple[RankEvidence, ...] = ()
    watch: WatchReport | None = None
    outside_signal: str | None = None
    """A signal the agent received from outside the job (``SIGTERM`` from the scheduler, Ctrl-C's ``SIGINT``)."""
    all_preempted: bool = False
    """The agent said every rank stopped after a preemption signal (75 or 76, the others ended by SIGTERM)."""


def classify(evidence: Evidence) -> Classification:
    """The class of a failed attempt (``evidence.exit_code`` non-zero), by the rules of the module's docstring."""
    ranks = sorted(evidence.ranks, key=lambda r: (not r.first, r.rank))
    lines = tuple(r.said() for r in ranks) + (evidence.watch.lines if evidence.watch else ())
    if evidence.outside_signal:
        return Classification(kind=FailureClass.PREEMPTED, evidence=lines,
                              reason=f"the job received {evidence.outside_signal} from outside (the scheduler's "
                                     "signal)")
    if evidence.all_preempted:
        return Classification(kind=FailureClass.PREEMPTED, evidence=lines,
                              reason=f"the workers stopped after a preemption signal (exit {evidence.exit_code})")
    failed = [r for r in ranks if r.signal or r.exit_code is not None]
    codes = {r.exit_code for r in failed if r.exit_code is not None}
    if failed and codes and codes <= set(_PREEMPTED_CODES) and all(r.signal in (None, "SIGTERM") for r in failed):
        return Classification(kind=FailureClass.PREEMPTED, evidence=lines, culprit_ranks=_ranks(failed),
                              reason=f"the workers stopped after a preemption signal (exit {min(codes)})")
    if evidence.watch and evidence.watch.stopped_answering:
        gone = evidence.watch.stopped_answering
        return Classification(kind=FailureClass.HOST, evidence=lines, culprit_ranks=tuple(r for r, _ in gone),
                              culprit_hosts=tuple(sorted({h for _, h in gone})),
                              reason="; ".join(f"rank {r} on host {h} stopped answering" for r, h in gone))
    own = [r for r in ranks if r.on_its_own and (r.signal or r.exception or r.exit_code is not None)]
    if own:
        first = own[0]
        if first.signal == "SIGTERM":  # not its agent's (that one is stopped_by_ddpkit): a signal from outside
            return Classification(kind=FailureClass.PREEMPTED, evidence=lines, culprit_ranks=(first.rank,),
                                  culprit_hosts=(first.host,),
                                  reason=f"rank {first.rank} on host {first.host} received SIGTERM from outside")
        if first.signal:
            killed = [r for r in own if r.signal]
            return Classification(kind=FailureClass.HOST, evidence=lines, culprit_ranks=_ranks(killed),
                                  culprit_hosts=_hosts(killed),
                                  reason="; ".join(f"rank {r.rank} on host {r.host} was killed by {r.signal}"
                                                   for r in killed))
        if first.exception:
            same = [r for r in own if r.exception == first.exception]
            where = f"rank {first.rank}" if len(same) == 1 else _listed(same)
            return Classification(kind=FailureClass.JOB, evidence=lines, culprit_ranks=_ranks(same),
                                  culprit_hosts=_hosts(same),
                                  reason=f"{first.exception} on {where} (host {', '.join(_hosts(same))})")
        return Classification(kind=FailureClass.UNKNOWN, evidence=lines, culprit_ranks=(first.rank,),
                              culprit_hosts=(first.host,),
                              reason=f"rank {first.rank} on host {first.host} exited with code {first.exit_code} "
                                     "and left no traceback")
    lost = [r for r in ranks if r.peer_failure]
    if lost:
        return Classification(kind=FailureClass.HOST, evidence=lines,
                              reason=f"{_listed(lost)} lost a peer ({_short(lost[0].exception)}) "
                                     "and no rank failed on its own: a rank or its link was cut off")
    stopped = [r for r in ranks if r.stopped_by_ddpkit]
    if stopped:
        return Classification(kind=FailureClass.UNKNOWN, evidence=lines,
                              reason=f"ddpkit stopped {_listed(stopped)} (a hang or a deadline) "
                                     "and no report names a rank that stopped answering")
    return Classification(kind=FailureClass.UNKNOWN, evidence=lines,
                          reason=f"the attempt failed with exit code {evidence.exit_code} and left no evidence")


def _ranks(found: Sequence[RankEvidence]) -> tuple[int, ...]:
    return tuple(sorted({r.rank for r in found}))


def _listed(found: Sequence[RankEvidence]) -> str:
    """``rank 1``, ``ranks 0, 1``: each rank named."""
    return rank_list((r.rank for r in found), spans=False)


def _hosts(found: Sequence[RankEvidence]) -> tuple[str, ...]:
    return tuple(sorted({r.host for r in found}))


def _short(text: str | None, limit: int = 200) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."
