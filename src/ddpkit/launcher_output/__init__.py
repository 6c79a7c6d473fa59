"""What launchers print, read once: one reader per dialect turns lines into typed events, which the digest a person
reads (``ddpkit.launch.stepscreen``) and the classification a heal supervisor decides on (``ddpkit.heal``) both
read, so the two cannot disagree about who failed first. No torch; pure apart from the host's name.

The dialects (``reader_for``)::

    srun      srun --label: "T: text"; "srun: error: H: task T: Killed | Exited with exit code N"; its ending
    torchrun  one unlabelled stream (a rendered torchrun job, a pod's log: ``pods``)
    mpirun    Open MPI --tag-output: "[J,R]<stderr>:text"; its first failed process; a process a signal ended
    mpich     MPICH -prepend-rank: "[R] text"; names no failed rank

Every dialect reads ddpkit's own words (a logger's ``[host:rank]``, the watch's report and the ranks it says
stopped answering), torch's agent (a failed worker, its ``ChildFailedError``, its "Root Cause" box) and Slurm's
cancellation. The events (``events``) are values; the words they share are said once (``words``: signal names,
task and rank lists; ``tracebacks``: a traceback's frames and its exception's first line).

Reading srun's output::

    >>> from ddpkit.launcher_output import reader_for
    >>> reader_for("srun").read("srun: error: node2: task 1: Killed").events
    (TasksEnded(exit_code=None, signal=9, tasks=(1,), host='node2', after_step_ending=False),)
"""

from __future__ import annotations

from ddpkit.launcher_output.events import (
    Cancelled,
    Ending,
    Event,
    JobFailing,
    RankEnded,
    RankOnHost,
    RankTraceback,
    RootCause,
    SilentRank,
    StepEnding,
    TasksEnded,
    WatchLine,
    WorkerFailed,
)
from ddpkit.launcher_output.mpich import MpichReader
from ddpkit.launcher_output.openmpi import OpenMpiReader
from ddpkit.launcher_output.reader import Reader, Reading
from ddpkit.launcher_output.srun import SrunReader
from ddpkit.launcher_output.torchrun import TorchrunReader

__all__ = ["Cancelled", "Ending", "Event", "JobFailing", "RankEnded", "RankOnHost", "RankTraceback", "Reader",
           "Reading", "RootCause", "SilentRank", "StepEnding", "TasksEnded", "WatchLine", "WorkerFailed",
           "reader_for"]

_DIALECTS: dict[str, type[Reader]] = {"srun": SrunReader, "torchrun": TorchrunReader, "mpirun": OpenMpiReader,
                                      "mpich": MpichReader}


def reader_for(launcher: str) -> Reader:
    """A fresh reader of ``launcher``'s output (``ddpkit step``'s name for it); a launcher with no dialect here is
    read as one unlabelled stream, named as it is."""
    dialect = _DIALECTS.get(launcher)
    return dialect() if dialect is not None else Reader(launcher)
