"""The one author and the one speaker of an attempt's line. After an attempt the supervisor says one line, ``ddpkit
heal: attempt N of M: what failed (its class); what happens next``: ``sentence`` words it from the policy's
decision (``policy.decide``: what to do and why, never how it reads) and the backend's way of keeping a bad host out
(``Style``, ``Placement``); ``say`` puts it on stderr. The ledger records the same line (``AttemptEnded.decision``).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.heal.policy import EXIT_DO_NOT_REQUEUE, Decision, Why
from ddpkit.rundir.verdict import Classification, FailureClass

__all__ = ["Placement", "Style", "agent_failed", "say", "sentence"]


def say(line: str) -> None:
    """A supervisor's line for the person watching (stderr, flushed: it goes between the ranks' own lines)."""
    print(line, file=sys.stderr, flush=True)


class Style(enum.Enum):
    """How a backend keeps a bad host out, and so how the retry line reads (``sentence``)."""

    ONE_HOST = "one-host"
    """``run|train -n N --heal``: the same host again; nothing to exclude."""
    HOSTS = "hosts"
    """mpirun on ``--hosts``: "node2 excluded for the rest of the run; relaunching on node1, node3"."""
    ALLOCATION = "allocation"
    """A Slurm allocation: "node2 excluded (its cause); relaunching on node1, node3" (drained with --on-fail)."""
    AFFINITY = "affinity"
    """Kubernetes: the next PyTorchJob keeps the node out ("nodeAffinity NotIn")."""
    RENDEZVOUS = "rendezvous"
    """torch elastic across hosts: the host leaves the rendezvous; the others meet in the next round."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a retried attempt goes on (the retry line's second half)."""

    excluded: Sequence[str] = ()
    """The hosts this attempt's failure took out."""
    drained: bool = False
    hosts: Sequence[str] | None = ()
    """The next attempt's hosts; None: too few left."""
    least: int = 0
    """``-j MIN:N``'s MIN (``Style.ALLOCATION``)."""
    want: int = 0
    """``-j MIN:N``'s N."""
    here: str = ""
    """This host (``Style.RENDEZVOUS``: the one that rejoins)."""


def sentence(style: Style, decision: Decision, found: Classification | None, *, of_session: int, max_attempts: int,
             exit_code: int, progress: int | None = None, placed: Placement | None = None) -> str:
    """The line after an attempt: what failed (``found``), what the policy decided and, for a retry, where the run
    goes on. ``exit_code``: the attempt's own."""
    head = f"ddpkit heal: attempt {of_session} of {max_attempts}"
    why = decision.why
    if why is Why.COMPLETED or found is None:
        return f"{head}: completed (exit {exit_code})"
    kind = "preempted" if found.kind is FailureClass.PREEMPTED else f"{found.kind.value} fault"
    what = f"{found.reason} ({kind})"
    own = f"(do not requeue; the job's own exit code was {exit_code})"
    if why is Why.PREEMPTED:
        return f"{head}: {what}; stopping with exit {exit_code} (not relaunched here: the scheduler may requeue it)"
    if why is Why.JOB_AGAIN:
        return (f"{head}: {what}, the second in a row: retrying cannot help; stopping with exit "
                f"{EXIT_DO_NOT_REQUEUE} {own}")
    if why is Why.STALLED:
        return (f"{head}: {what}; {decision.stalled} attempts in a row without a newer snapshot: stopping with exit "
                f"{EXIT_DO_NOT_REQUEUE} {own}")
    if why is Why.NO_ATTEMPT_LEFT:
        return f"{head}: {what}; no attempt left (--max-attempts {max_attempts}): giving up with exit {exit_code}"
    if why is Why.NO_RESTART_LEFT:
        return (f"ddpkit heal: {found.reason}; this agent has no restart left (--max-attempts {max_attempts}): "
                f"stopping with exit {exit_code}")
    return _retry(style, head, what, found, progress, placed or Placement())


def _retry(style: Style, head: str, what: str, found: Classification, progress: int | None,
           placed: Placement) -> str:
    since = "" if progress is None else f" from the snapshot of step {progress}"
    once = found.kind is FailureClass.JOB
    again = " (a second such failure stops the job)" if once else ""
    out, hosts = ", ".join(placed.excluded), placed.hosts
    if style is Style.RENDEZVOUS:
        return (f"{head}: {what}" + (f"; {out} excluded from later rounds" if out else "")
                + f"; {placed.here} rejoins the rendezvous" + (f", resuming{since}" if since else ""))
    if style is Style.ALLOCATION and found.kind is FailureClass.HOST:
        if not out:
            return f"{head}: {what}; relaunching on the same nodes{since}"
        cause = f"{out} excluded{' and drained' if placed.drained else ''} ({found.reason})"
        if hosts is None:
            return f"{head}: {cause}; fewer than {placed.least} healthy node(s) left"
        fewer = f" (shrunk to {len(hosts)} of {placed.want} nodes: -j {placed.least}:{placed.want})" \
            if len(hosts) < placed.want else ""
        return f"{head}: {cause}; relaunching on {', '.join(hosts)}{fewer}{since}"
    if style is Style.HOSTS:
        line = f"{head}: {what}" + (f"; {out} excluded for the rest of the run" if out else "")
        if hosts is None:
            return f"{line}; no host set left for the next attempt"
        return f"{line}; relaunching{' once' if once else ''} on {', '.join(hosts)}{again}{since}"
    line = f"{head}: {what}; relaunching{' once' + again if once else since}"
    if style is Style.AFFINITY and out:
        line += f"; node {out} kept out of the next attempt (nodeAffinity NotIn)"
    return line


def agent_failed(of_session: int, exc: BaseException) -> str:
    """The ledger's line for an attempt whose agent itself failed (the exception is raised on, and says itself)."""
    return f"ddpkit heal: attempt {of_session}: the agent ended with {type(exc).__name__}: {exc}; stopping"
