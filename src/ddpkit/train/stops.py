"""How a training run stops, told truly: the worker's half of ``ddpkit.stopping``'s state machine.

- A preemption is a signal from outside the job (Slurm, a scancel, a user). Under ddpkit's launcher the agent
  marks the signals it received (``ddpkit.stopping``); a SIGTERM without that mark is the agent stopping its
  workers after a failure, a lost rendezvous store or a membership change: not a preemption, and never reported as
  one. Under other launchers (srun, mpirun, torchrun) every signal counts as from outside: they leave no mark
  (torchrun's own stops look like preemptions there, but a stop after a lost peer still fails as below).
- A preemption exits 75 only when a snapshot exists to resume from; without --snapshot-path it says that the
  progress since the start (or the snapshot it resumed from) is lost, and exits 76.
- A lost peer: a collective failed or timed out (--collective-timeout). Every rank that can still reach the
  workers' store (rank 0's) leaves a key there; after PROBE_S the ranks without a key are the ones that stopped
  answering. A rank that cannot reach the store names rank 0's host as the one lost. The message names the rank
  and host, the phase (which collective of which step) and the snapshot the next run resumes from; exit 3.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from ddpkit.log import get_logger
from ddpkit.stopping import RunOutcome, leave_lost_report
from ddpkit.worker_context import WorkerContext

if TYPE_CHECKING:
    from ddpkit.runtime import Runtime

__all__ = ["PROBE_S", "LastSnapshot", "describe_lost_peer", "host_table", "preemption_outcome", "probe_answering",
           "report_lost_peer", "silent_ranks"]

log = get_logger(__name__)

#: Seconds the ranks that can still reach the store wait for each other's keys after a collective failed.
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
                       answered: set[int] | None, error: str) -> str:
    """One message: who stopped answering (rank and host), in which phase, and where the next run resumes.
    ``answered`` is None when this rank could not reach the store on rank 0's host."""
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
        lost = (f"{who(silent)} stopped answering" if silent else
                "every rank still answers the store, but a collective between them failed (a broken link)")
    error = error.rsplit("] ", 1)[-1]  # gloo's message without its source path
    return (f"rank {rank}: a collective failed, another rank is gone: {lost}, during {phase}; {snapshot} "
            f"({error})")


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


def probe_answering(rank: int, world_size: int, context: WorkerContext, wait: float = PROBE_S) -> set[int] | None:
    """Leave this rank's key in the workers' store (rank 0's, at MASTER_ADDR:MASTER_PORT) and return the ranks
    whose keys are there after ``wait`` s; None when the store cannot be reached."""
    import torch.distributed as dist

    if context.master is None:
        return None
    host, port = context.master
    prefix = f"ddpkit/lost/{context.run_id}/{context.restart_count}/"
    deadline = time.monotonic() + wait
    try:  # a plain connection first: a TCPStore that cannot connect prints a C++ stack trace
        socket.create_connection((host, int(port)), timeout=max(1.0, wait / 2)).close()
    except OSError:
        return None
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(1.0, wait / 2)),
                              wait_for_workers=False)
        store.set(f"{prefix}{rank}", "1")
        answered = {rank}
        while time.monotonic() < deadline and len(answered) < world_size:
            time.sleep(0.2)
            answered |= {r for r in range(world_size) if r not in answered and store.check([f"{prefix}{r}"])}
    except Exception:  # the store (rank 0's host) is out of reach, or rank 0 is gone and took it along
        return None
    return answered


def report_lost_peer(message: str, rank: int, context: WorkerContext) -> None:
    """Log the diagnosis and leave it for ddpkit's agent (which bounds its own exit once no restart is left)."""
    log.error("%s", message)
    leave_lost_report(context.stop_dir, rank, f"{message} (on {socket.gethostname()})",
                      restartable=context.restartable)
