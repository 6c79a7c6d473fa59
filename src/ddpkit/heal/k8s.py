"""Kubernetes: a failed attempt of a rendered PyTorchJob judged from its pods, and the next attempt kept off the
node at fault (``nodeAffinity`` ``NotIn`` on ``kubernetes.io/hostname``).

What a pod left (``PodEnd``: its name, the node it ran on, its container's exit code, its log) is the evidence:
a container killed by a signal (exit 128+N, as the runtime reports it) names its node; the watch's line "rank R on
host POD stopped answering" names the node that pod ran on; the same traceback on the pods is the program's own
failure (retried once, then 93). ``record_attempt`` classifies (``classify``), writes the run's ledger
(``RUN_DIR/ledger.jsonl``: the attempt, its end, a ``HostExcluded`` record per node taken out) and decides
(``policy``); the next attempt is rendered with the ledger's nodes kept out::

    ddpkit submit k8s -j 2x1 --image IMAGE --exclude-from RUN_DIR --name job-a2 -- train ...

(``jobs.exclude`` reads a heal run directory as it reads a check report). tests/infra/test_heal_k8s.py runs both
attempts on the project's Kubernetes harness, the pods placed on nodes as the scheduler would place them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ddpkit.heal.attempts import Attempts, Conclusion, Ended
from ddpkit.heal.classify import Evidence, RankEvidence
from ddpkit.heal.evidence import rank_ended, watch_of
from ddpkit.heal.lines import Style
from ddpkit.heal.policy import HealPolicy
from ddpkit.launcher_output import Ending, RankTraceback, SilentRank
from ddpkit.launcher_output.pods import pod_events
from ddpkit.rundir.ledger import AttemptStarted, HostExcluded, Ledger

__all__ = ["PodEnd", "evidence_of", "record_attempt"]


@dataclass(frozen=True, kw_only=True)
class PodEnd:
    """One pod of an ended attempt, as ``kubectl get pod -o json`` and ``kubectl logs`` show it."""

    pod: str
    """The pod's name (its hostname: what the watch calls its host)."""
    node: str
    """``spec.nodeName``: the node's ``kubernetes.io/hostname``."""
    exit_code: int
    """The container's last exit code (128+N for a signal)."""
    log: str = ""


def evidence_of(pods: Sequence[PodEnd], exit_code: int) -> Evidence:
    """The attempt's evidence, hosts by node name, from each pod's log read as the digest reads it
    (``launcher_output.pods``): a pod's rank is the first its log names (``[POD:RANK]``, the prefix of ddpkit's
    lines), else its index in ``pods``; its exception, its last traceback's (never torchrun's own report)."""
    node_of = {p.pod: p.node for p in pods}
    ranks: list[RankEvidence] = []
    silent: list[SilentRank] = []
    for i, p in enumerate(pods):
        rank, events = pod_events(p.pod, p.log, i)
        silent += [e for e in events if isinstance(e, SilentRank) and e.headline]
        said = next((e.exception for e in events if isinstance(e, RankTraceback)), None)
        how = Ending(signal=p.exit_code - 128) if p.exit_code > 128 else Ending(exit_code=p.exit_code)
        if p.exit_code or said:
            ranks.append(rank_ended(rank, p.node, how, exception=said, stopped_by_ddpkit=p.exit_code == 3))
    # the pod a signal ended goes first: the others' failures (a lost peer, torchrun's exit 1) follow from it
    ranks.sort(key=lambda r: r.signal is None)
    ranks = [replace(r, first=i == 0) for i, r in enumerate(ranks)]
    watch = watch_of([s for s in silent if s.host in node_of], lines=[s.line for s in silent],
                     host_of=lambda s: node_of[s.host], most=10) if silent else None
    return Evidence(exit_code=exit_code, ranks=tuple(ranks), watch=watch)


def record_attempt(ledger: Ledger, pods: Sequence[PodEnd], *, started: float, policy: HealPolicy,
                   progress: int | None = None) -> tuple[Conclusion, tuple[str, ...]]:
    """Record one ended attempt of the job (its pods) in ``ledger`` and decide (``heal.attempts``): (the conclusion,
    every node the run keeps out from now on, this attempt's included). The operator started the attempt; the
    caller says the line."""
    attempts = Attempts(ledger=ledger, policy=policy, style=Style.AFFINITY)
    attempt = ledger.next_attempt()
    code = next((p.exit_code for p in pods if p.exit_code), 0)
    attempts.started(attempt, tuple(dict.fromkeys(p.node for p in pods)), len(pods), at=started)
    of_session = sum(1 for r in ledger.records() if isinstance(r, AttemptStarted))
    conclusion = attempts.conclude(attempt, of_session, Ended(exit_code=code, evidence=evidence_of(pods, code)
                                                               if code else None), progress=progress, quiet=True)
    return conclusion, _excluded(ledger)


def _excluded(ledger: Ledger) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.host for r in ledger.records() if isinstance(r, HostExcluded)))
