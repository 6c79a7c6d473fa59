"""One reader of a launcher's output: lines in, each split into its source (the task or rank the launcher's label
names; None for the launcher's own lines, or a stream with no labels) and its text, with the events it states.

Every dialect reads ddpkit's own words (``ddpkit_lines``), torch's agent (``torch_agent``: under srun each task may
be a torchrun agent) and Slurm's cancellation (a job step in a batch job); a dialect adds its label and its
launcher's own lines (``srun``, ``openmpi``, ``mpich``, ``torchrun``). A reader holds what spans lines (a report, a
box, mpirun's two lines on a process), so it reads one output from its first line to its last: ``finish`` ends
what the output's end cut short."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ddpkit.launcher_output.ddpkit_lines import WatchReader, rank_prefix
from ddpkit.launcher_output.events import Cancelled, Event
from ddpkit.launcher_output.torch_agent import BoxReader, job_failing, worker_failed

__all__ = ["Reader", "Reading"]

#: slurmstepd's "*** STEP 7.0 ON node1 CANCELLED AT 2026-11-26T13:33:40 DUE TO JOB REQUEUE ***" (or JOB ...)
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO [^*]+)? \*\*\*")


@dataclass(frozen=True)
class Reading:
    """One line, read."""

    source: int | None
    """The task (srun) or rank (mpirun, mpiexec) whose line it is; None: the launcher's own, or an unlabelled
    stream's (torchrun's)."""
    text: str
    """The line without the launcher's label."""
    events: tuple[Event, ...] = ()
    quiet: bool = False
    """A line of the launcher's that says nothing (the frame of mpirun's boxes)."""


class Reader:
    """A launcher's output with no labels and no lines of its own that ddpkit knows (a launcher it has no dialect
    for). Dialects override ``_label`` and ``_own``, and say how the digest names them."""

    name = ""
    """The launcher, as ``ddpkit step`` and the digest name it."""
    program = ""
    """The program whose exit code the digest quotes."""
    unit = "job"
    """What failed: a ``job step`` (srun's) or a ``job``."""
    logs_of = "every node and rank"
    """Whose lines the full log holds."""
    names_failures = True
    """Whether the launcher names the processes that failed (MPICH's mpiexec does not)."""
    localhost_is_here = True
    """A torchrun box's "localhost" is this host (not under srun, whose tasks run elsewhere)."""

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = self.program = name
        self._watch = WatchReader()
        self._boxes: dict[int | None, BoxReader] = {}

    def read(self, line: str) -> Reading:
        source, text = self._label(line)
        events: list[Event] = []
        prefix = rank_prefix(text)
        if prefix is not None:
            events.append(prefix)
        events += self._watch.read(source, text)
        failed = worker_failed(text)
        if failed is not None:
            events.append(failed)
        events += self._own(source, text, line)
        failing = job_failing(text)
        if failing is not None:
            events.append(failing)
        cancelled = _CANCELLED.search(text)
        if cancelled:
            events.append(Cancelled(text=cancelled[0].strip("* ")))
        events += self._box(source).read(text)
        return Reading(source, text, tuple(events), quiet=self._quiet(source, text))

    def finish(self) -> list[tuple[int | None, Event]]:
        """What the end of the output cut short (a box's last entry), by source."""
        return [(source, event) for source, box in self._boxes.items() for event in box.done()]

    def read_all(self, lines: Iterable[str]) -> list[tuple[int | None, Event]]:
        """Every event of a whole output, by source, in order."""
        found = [(reading.source, event) for reading in map(self.read, lines) for event in reading.events]
        return found + self.finish()

    # -- a dialect's own ------------------------------------------------------------------------------------------
    def _label(self, line: str) -> tuple[int | None, str]:
        return None, line

    def _own(self, source: int | None, text: str, line: str) -> list[Event]:
        """The launcher's own lines' events."""
        return []

    def _quiet(self, source: int | None, text: str) -> bool:
        return False

    def _box(self, source: int | None) -> BoxReader:
        box = self._boxes.get(source)
        if box is None:
            box = self._boxes[source] = BoxReader(localhost_is_here=self.localhost_is_here)
        return box
