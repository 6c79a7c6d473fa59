"""The run's ledger: one JSON line per event in ``RUN_DIR/ledger.jsonl``, appended and never rewritten.

Events: a supervisor started (``SupervisorStarted``), an attempt started (``AttemptStarted``: its number, time,
hosts and ranks), an attempt ended (``AttemptEnded``: time, exit code, the classification, the action taken, the
progress it reported, the line said to the person watching). Lines are written and read by ``base.jsonlines``
(one whole fsynced line each; a torn last line skipped). A second supervisor on the same run directory (a rerun,
a requeued job) appends: attempt numbers continue. Pure: no torch, no processes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import field
from pathlib import Path

from ddpkit.base.jsonlines import Kinds, append_to, encode, record
from ddpkit.rundir.verdict import Classification

__all__ = ["LEDGER", "Action", "AttemptEnded", "AttemptStarted", "FaultSeen", "HostExcluded", "Ledger", "LiveHook",
           "PreflightEnded", "RankReplaced", "Record", "ReplicasDiverged", "SupervisorStarted", "heal_sentence",
           "ranks_command", "read_records"]

LEDGER = "ledger.jsonl"


class Action(enum.Enum):
    """What the supervisor did after an attempt ended."""

    RETRY = "retry"
    """Another attempt was started."""
    STOP = "stop"
    """The run ended: it completed, was preempted, or failed in a way another attempt cannot mend."""
    GIVE_UP = "give-up"
    """The run ended because no attempt was left (``--max-attempts``)."""


@record("supervisor-started")
class SupervisorStarted:
    """A supervisor began on this run directory (the first, or one after a rerun or requeue)."""

    time: float
    pid: int
    host: str
    max_attempts: int
    command: tuple[str, ...] = ()
    """The ddpkit command line the ranks run, without the program's name (``train --epochs 5``, ``run -- job.py``):
    one meaning for every backend (``ranks_command``); the report shows it after ``ddpkit``."""


def ranks_command(program: tuple[str, ...]) -> tuple[str, ...]:
    """``SupervisorStarted.command`` from the ranks' whole program line (``python -m ddpkit train ...``): the words
    after ``ddpkit``; a program that is not ddpkit is said whole."""
    words = list(program)
    for i, word in enumerate(words):
        if word == "ddpkit" or word.endswith("/ddpkit"):
            return tuple(words[i + 1:])
    return tuple(words)


@record("attempt-started")
class AttemptStarted:
    attempt: int
    """1 for the run directory's first attempt; a later supervisor continues the count."""
    time: float
    hosts: tuple[str, ...]
    ranks: int
    """The world size of the attempt."""
    logs: str | None = None
    """Where the attempt's per-rank logs are, where they are kept."""


@record("attempt-ended")
class AttemptEnded:
    attempt: int
    time: float
    exit_code: int
    action: Action
    classification: Classification | None = None
    """None for an attempt that succeeded (exit 0)."""
    progress: int | None = None
    """The newest snapshot step the job reported by the attempt's end; None when unknown (a user's script)."""
    decision: str = ""
    """The line said to the person watching."""
    exit_code_of_run: int | None = field(default=None)
    """The run's exit code, where the action ended the run."""


@record("fault-seen")
class FaultSeen:
    """The supervisor saw the attempt fail (a backend that watches its attempt live: ``heal.slurm``): the first
    line that said so (a rank that failed, one the watch named silent), when; the attempt's end comes later."""

    attempt: int
    time: float
    line: str


@record("host-excluded")
class HostExcluded:
    """A host taken out of the run for good (a host fault named it, or a preflight check failed on it)."""

    attempt: int
    """The attempt whose failure named it."""
    time: float
    host: str
    reason: str
    drained: bool = False
    """``--on-fail drain``: the scheduler was told to drain it (``scontrol update ... state=drain``)."""


@record("preflight-ended")
class PreflightEnded:
    """A quick ``ddpkit check`` on the node set of the next attempt, before it starts."""

    attempt: int
    """The attempt it cleared the way for."""
    start: float
    end: float
    hosts: tuple[str, ...]
    exit_code: int
    bad_hosts: tuple[str, ...] = ()


@record("rank-replaced")
class RankReplaced:
    """Under ``--heal live``: a rank lost and replaced within an attempt, the others keeping their processes
    (``ddpkit.live.agent.rules`` makes it, the supervisor records it): when it was lost, when the replacement held the
    state a peer gave it, and when it applied its first step; no step was lost."""

    rank: int
    host: str
    why: str
    """``SIGKILL``, ``stopped (SIGSTOP)``: how the rank was lost."""
    lost_at: float
    """The first sign the agent saw: the process gone, or stopped (the kernel's state T)."""
    lost_pid: int
    replacement_pid: int
    kept: tuple[int, ...] = ()
    """The ranks that kept their processes."""
    attempt: int = 0
    """The attempt it happened in (the supervisor's number; 0 before it is recorded)."""
    gen: int = 0
    """The group's generation the replacement joined (``ddpkit.live.protocol``)."""
    source: int | None = None
    """The rank whose memory the replacement took its state from."""
    step: int | None = None
    """The global step the group went on from."""
    decided_at: float | None = None
    """When the agent took it for lost (a stopped rank: ``STOPPED_S`` later, when it was ended)."""
    joined_at: float | None = None
    first_step_at: float | None = None
    arrived_at: float | None = None
    """The hand-over's parts, on the source: the survivors met at the generation's store (``arrived_at``), the group
    formed with the replacements (``formed_at``), the state held by every rank (``joined_at``)."""
    formed_at: float | None = None
    replacement_host: str | None = None
    """Where the replacement runs, where not on the lost rank's host (a standby spare under Slurm)."""
    together: tuple[int, ...] = ()
    """Every rank lost with it and replaced in the same generation (itself included)."""

    def sentence(self) -> str:
        """The line a person reads, once the replacement applied its first step."""
        return heal_sentence([self])


def heal_sentence(heals: Sequence[RankReplaced]) -> str:
    """One line for the ranks one generation replaced, once their replacements applied their first step (by then
    the replicas were compared, one step after the heal: equal, or the attempt would have ended)."""
    head, one = heals[0], len(heals) == 1
    found = head.decided_at or head.lost_at
    took = "" if head.joined_at is None else f" {head.joined_at - found:.2f} s after the loss was found"
    first = "" if head.first_step_at is None else \
        f"; {'its' if one else 'their'} first step {head.first_step_at - found:.2f} s after"
    ranks = ", ".join(str(h.rank) for h in heals)
    one_node = len({h.host for h in heals}) == 1 and len({h.why.split(" for ")[0] for h in heals}) == 1
    if one:
        lost = f"rank {head.rank} on {head.host} lost ({head.why})"
    elif one_node:  # a node's ranks, lost alike (how long each was stopped said only where they agree)
        why = head.why if len({h.why for h in heals}) == 1 else head.why.split(" for ")[0]
        lost = f"ranks {ranks} on {head.host} lost together ({why})"
    else:
        lost = f"ranks {ranks} lost together (" + "; ".join(f"rank {h.rank} on {h.host}: {h.why}" for h in heals) + ")"
    to = {h.replacement_host for h in heals}
    if one:
        went = f"a replacement{'' if head.replacement_host is None else f' on {head.replacement_host}'} (pid " \
               f"{head.replacement_pid})"
    elif len(to) == 1:  # onto one spare node (or this host)
        (where,) = to
        went = f"replacements{'' if where is None else f' on {where}'} (pids " \
               f"{', '.join(str(h.replacement_pid) for h in heals)})"
    else:
        went = "replacements (" + ", ".join(f"rank {h.rank} pid {h.replacement_pid}" + (
            "" if h.replacement_host is None else f" on {h.replacement_host}") for h in heals) + ")"
    return (f"ddpkit heal: {lost}; {went} took "
            f"{'its' if one else 'their'} state from rank {head.source} at step {head.step}{took}{first}; "
            f"rank(s) {', '.join(map(str, head.kept))} kept their processes; replicas equal after it; no step lost")


@record("replicas-diverged")
class ReplicasDiverged:
    """Under ``--heal live``: the replicas' digests (weights and optimizer state) disagreed one step after a heal or
    at the end of the run; the attempt was ended (``ddpkit.live.rank.group``)."""

    gen: int
    step: int
    digests: tuple[str, ...]
    """Each rank's digest (rank -> hex)."""
    where: str
    at: float
    attempt: int = 0


#: Where an attempt tells the loop of each live heal within it (``--heal live``: ``ddpkit.live.agent``), and of
#: replicas found to differ (``ddpkit.heal.attempts`` records each).
LiveHook = Callable[[RankReplaced | ReplicasDiverged], None]

Record = (SupervisorStarted | AttemptStarted | AttemptEnded | FaultSeen | HostExcluded | PreflightEnded | RankReplaced
          | ReplicasDiverged)
_KINDS: Kinds[Record] = Kinds("ledger", (SupervisorStarted, AttemptStarted, AttemptEnded, FaultSeen, HostExcluded,
                                         PreflightEnded, RankReplaced, ReplicasDiverged))


def to_json(record: Record) -> str:
    """One line (no newline in it)."""
    return encode(record)


def from_json(line: str) -> Record:
    """The record of one line; ValueError for a line that is not one (a torn write, an unknown kind)."""
    return _KINDS.decode(line)


def read_records(path: str | Path) -> list[Record]:
    """Every record of a ledger file, oldest first; a torn last line is skipped; a missing file is an empty ledger."""
    return _KINDS.read(path)


class Ledger:
    """``RUN_DIR/ledger.jsonl``: appended one fsynced line at a time."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEDGER

    def append(self, record: Record) -> None:
        """Write ``record`` as one fsynced line (a new file's directory fsynced too)."""
        append_to(self.path, encode(record))

    def records(self) -> list[Record]:
        return read_records(self.path)

    def ended(self) -> list[AttemptEnded]:
        return [r for r in self.records() if isinstance(r, AttemptEnded)]

    def next_attempt(self) -> int:
        """The number of the next attempt: one more than any recorded (started or ended)."""
        numbers = [r.attempt for r in self.records() if isinstance(r, AttemptStarted | AttemptEnded)]
        return max(numbers, default=0) + 1

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records())

