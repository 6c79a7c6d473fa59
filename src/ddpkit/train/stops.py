"""How a training run stops, told truly: the worker's half of ``ddpkit.process.stopping``'s state machine.

- A preemption is a signal from outside the job (Slurm, a scancel, a user). Under ddpkit's launcher the agent
  marks the signals it received (``ddpkit.process.stopping``); a SIGTERM without that mark is the agent stopping its
  workers after a failure, a lost rendezvous store or a membership change: not a preemption, and never reported as
  one. Under other launchers (srun, mpirun, torchrun) every signal counts as from outside: they leave no mark
  (torchrun's own stops look like preemptions there, but a stop after a lost peer still fails as below).
- A preemption exits 75 only when a snapshot exists to resume from; without --snapshot-path it says that the
  progress since the start (or the snapshot it resumed from) is lost, and exits 76.
- A lost peer: the watch (``ddpkit.watch``, installed by ``train``) tells who stopped answering from the
  heartbeats every rank publishes in the job's store. Either a collective failed (a killed peer: its connections
  reset), and the trainer asks the watch which ranks still answer (waiting at most PROBE_S), or no rank progressed
  for --collective-timeout while one waits in a collective (a stopped rank, a cut link), and the watch reports the
  hang, with every live rank's stack, and runs train's abort handler before every rank exits 3. A rank that cannot
  reach the store names rank 0's host as the one lost. The message names the rank and host, the phase (which
  collective of which step) and the snapshot the next run resumes from; exit 3.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpkit.base.log import get_logger
from ddpkit.process.stopping import RunOutcome, leave_lost_report
from ddpkit.process.worker_context import WorkerContext

if TYPE_CHECKING:
    from ddpkit.runtime import Runtime

__all__ = ["PROBE_S", "LastSnapshot", "LostPeerReport", "describe_lost_peer", "host_table", "preemption_outcome",
           "report_lost_peer", "silent_ranks"]

log = get_logger(__name__)

#: Seconds a rank whose collective failed waits for the other ranks' heartbeats before naming the silent ones.
PROBE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class LastSnapshot:
    """The snapshot a rerun resumes from, as this rank knows it."""

    configured: bool
    """--snapshot-path was given."""
    step: int | None = None
    """Its global step; None: no snapshot exists."""
    path: str | None = None

    def exists(self) -> bool:
        return self.step is not None

    def __str__(self) -> str:
        if not self.configured:
            return "no --snapshot-path was given: the next run starts from the beginning"
        if self.step is None:
            return "no snapshot was written yet: the next run starts from the beginning"
        return f"the next run resumes from the snapshot of step {self.step} ({self.path})"


def preemption_outcome(snapshot: LastSnapshot, step: int) -> tuple[RunOutcome, str]:
    """The outcome and the one line rank 0 prints after a preemption stopped training after ``step``."""
    saved, unsaved = RunOutcome.PREEMPTED_SAVED, RunOutcome.PREEMPTED_UNSAVED
    if snapshot.step == step:
        return saved, f"snapshot written at step {step}; exiting with {saved.exit_code}"
    if snapshot.step is not None:
        return saved, (f"no snapshot written now; steps {snapshot.step + 1}-{step} are lost and {snapshot}; "
                       f"exiting with {saved.exit_code}")
    return unsaved, f"no snapshot: {snapshot}, the {step} steps done are lost; exiting with {unsaved.exit_code}"


def silent_ranks(world_size: int, answered: set[int]) -> list[int]:
    """The ranks that left no key in the probe."""
    return [r for r in range(world_size) if r not in answered]


def describe_lost_peer(*, rank: int, hosts: list[str], phase: str, snapshot: LastSnapshot,
                       answered: set[int] | None, error: str, stalled: bool = False) -> str:
    """One message: who stopped answering (rank and host), in which phase, and where the next run resumes.
    ``answered`` is None when this rank could not reach the store on rank 0's host. ``stalled``: no collective
    failed; the watch found no progress for --collective-timeout (its report, above, names the rank behind)."""
    def who(ranks: list[int]) -> str:
        by_host: dict[str, list[int]] = {}
        for r in ranks:
            by_host.setdefault(hosts[r] if r < len(hosts) else "an unknown host", []).append(r)
        return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on {h}"
                         for h, rs in by_host.items())

    if answered is None:
        master = [r for r in range(len(hosts)) if hosts[r] == hosts[0]] or [0]
        lost = (f"{who(master)} stopped answering: rank {rank} cannot reach the store on rank 0's host either "
                "(this host lost its link, or that host is down)")
    else:
        silent = silent_ranks(len(hosts), answered)
        if silent:
            lost = f"{who(silent)} stopped answering"
        elif stalled:
            lost = ("every rank still answers, but no rank made progress in its collectives for --collective-timeout "
                    "(the watch's report names the rank behind)")
        else:
            lost = "every rank still answers the store, but a collective between them failed (a broken link)"
    error = error.rsplit("] ", 1)[-1]  # gloo's message without its source path
    what = "the job stalled" if stalled else "a collective failed, another rank is gone"
    return f"rank {rank}: {what}: {lost}, during {phase}; {snapshot} ({error})"


def host_table(rt: Runtime) -> list[str]:
    """Every rank's host as ``name (address)``, gathered once at start-up, so a lost peer can be named by host."""
    import torch.distributed as dist

    address = rt.interface.local_ip if rt.interface is not None else None
    mine = f"{socket.gethostname()} ({address})" if address else socket.gethostname()
    if rt.world_size == 1:
        return [mine]
    table: list[object] = [None] * rt.world_size
    dist.all_gather_object(table, mine)
    return [str(h) for h in table]


class LostPeerReport:
    """This rank's lost-peer report, left once: the trainer (a failed collective) and the watch's abort handler (a
    stall), on two threads, may both come to it."""

    def __init__(self, rank: int, context: WorkerContext) -> None:
        self.rank = rank
        self.context = context
        self._lock = threading.Lock()
        self.message: str | None = None

    def hand_over(self, message: str) -> bool:
        """Log and leave ``message`` unless a report was left already; True when this call left it."""
        with self._lock:
            if self.message is not None:
                return False
            self.message = message
        report_lost_peer(message, self.rank, self.context)
        return True


def report_lost_peer(message: str, rank: int, context: WorkerContext) -> None:
    """Log the diagnosis and leave it for ddpkit's agent (which bounds its own exit once no restart is left)."""
    log.error("%s", message)
    leave_lost_report(context.stop_dir, rank, f"{message} (on {socket.gethostname()})",
                      restartable=context.restartable)
