"""What a launcher's output says, as values: each event one fact a line (or a few lines) of it states. The digest a
person reads (``ddpkit.launch.stepscreen``) and the classification a heal supervisor decides on (``ddpkit.heal``)
read these, never the lines themselves.

How an event says how a process ended: ``exit_code`` where it exited, ``signal`` (its number) where a signal ended
it; ``code`` is the two in torch's way (negative: the signal)."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.launcher_output.words import signal_name

__all__ = ["Cancelled", "Ending", "Event", "JobFailing", "RankEnded", "RankOnHost", "RankTraceback", "RootCause",
           "SilentRank", "StepEnding", "TasksEnded", "WatchLine", "WorkerFailed"]


@dataclass(frozen=True, kw_only=True)
class Ending:
    """How a process ended: its exit code, or the signal that ended it."""

    exit_code: int | None = None
    signal: int | None = None

    @property
    def code(self) -> int | None:
        """torch's way: the exit code, or minus the signal."""
        return -self.signal if self.signal is not None else self.exit_code

    @property
    def signal_name(self) -> str | None:
        return signal_name(self.signal) if self.signal is not None else None

    @staticmethod
    def of(code: int) -> dict[str, int | None]:
        """The fields for torch's code (negative: the signal)."""
        return {"exit_code": None, "signal": -code} if code < 0 else {"exit_code": code, "signal": None}

    @classmethod
    def from_code(cls, code: int) -> Ending:
        """torch's code (negative: the signal) as an ending."""
        return Ending(**cls.of(code))


@dataclass(frozen=True, kw_only=True)
class RankOnHost:
    """A ddpkit logger's line prefix, ``[host:rank] ``: the rank runs on that host (a pod's name under Kubernetes)."""

    rank: int
    host: str


@dataclass(frozen=True, kw_only=True)
class WatchLine:
    """A line of the watch's report: its headline (``ddpkit watch: ...``) or a line under it."""

    text: str
    headline: bool


@dataclass(frozen=True, kw_only=True)
class SilentRank:
    """The watch says a rank stopped answering (its heartbeat stopped: a stopped or killed process, a lost host)."""

    rank: int
    host: str
    """As the watch names it: the rank's hostname (a pod's name under Kubernetes)."""
    pid: int | None
    line: str
    """The line that says it, stripped."""
    headline: bool
    """Said in the report's headline, not in a line under it (a hang's report names silent ranks under it)."""


@dataclass(frozen=True, kw_only=True)
class WorkerFailed(Ending):
    """torch's agent (torchrun's, ddpkit's): ``failed (exitcode: N) local_rank: L (pid: P)``; its global rank is not
    said."""

    local_rank: int
    pid: int


@dataclass(frozen=True, kw_only=True)
class RootCause(Ending):
    """One entry of torchrun's "Root Cause" box: a failed rank, its host and time, and its own traceback where it
    wrote torch's error file."""

    rank: int
    host: str | None
    """As the box says it; a standalone torchrun's "localhost" is already this host's name."""
    pid: int | None = None
    time: str = ""
    """torch's, to the second (``2026-11-26_13:31:44``)."""
    traceback: str = ""


@dataclass(frozen=True, kw_only=True)
class RankEnded(Ending):
    """The launcher names a rank that ended (Open MPI's first process with a non-zero exit code, or one a signal
    ended)."""

    rank: int
    host: str | None = None


@dataclass(frozen=True, kw_only=True)
class TasksEnded(Ending):
    """srun: ``srun: error: node2: tasks 0-1: Exited with exit code 3`` (or the signal's word, ``Killed``). A task is
    a rank where srun starts the ranks, an agent where it starts torchrun."""

    tasks: tuple[int, ...]
    host: str
    after_step_ending: bool = False
    """srun had said it is ending the step (``StepEnding``): srun ended these tasks."""


@dataclass(frozen=True, kw_only=True)
class StepEnding:
    """srun (or slurmstepd) says it is ending the step: ``--kill-on-bad-exit`` after a task failed, a cancel."""

    text: str


@dataclass(frozen=True, kw_only=True)
class Cancelled:
    """Slurm cancelled the step or the job: ``STEP 7.0 ON node1 CANCELLED AT ... DUE TO JOB REQUEUE``."""

    text: str


@dataclass(frozen=True, kw_only=True)
class JobFailing:
    """The launcher says the job failed, before (or without) naming a rank: torchrun's ``ChildFailedError``,
    mpirun's "Primary job terminated normally, but 1 process returned a non-zero exit code"."""

    text: str


@dataclass(frozen=True, kw_only=True)
class RankTraceback:
    """A rank's last Python traceback, from its own lines."""

    rank: int
    host: str | None
    exception: str
    """Its exception's first line (``ValueError: bad batch``), cut to 200 characters."""
    frames: tuple[str, ...] = ()
    text: str = ""
    """The traceback as the rank printed it, from its "Traceback" line."""


Event = (RankOnHost | WatchLine | SilentRank | WorkerFailed | RootCause | RankEnded | TasksEnded | StepEnding
         | Cancelled | JobFailing | RankTraceback)
