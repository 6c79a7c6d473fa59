"""The screen of a job step as ``ddpkit step`` shows it (``ddpkit.launch.steplog``): srun's lines in, with
``--label``'s task (or a rendered torchrun job's lines, one unlabelled stream; mpirun's or mpiexec's, tagged by
rank); out, the lines a user reads (no C++ frames, each C++ warning once, one usage error for all the ranks,
tracebacks held once a task prints one or an agent says a rank failed). Each line is read once by its launcher's
reader (``ddpkit.launcher_output``), whose events ``StepFacts`` keeps for the digest of a failed step. Pure apart
from the two streams it writes to."""

from __future__ import annotations

import re
import time
from collections import deque
from typing import TextIO

from ddpkit.launch.digest import is_noise
from ddpkit.launch.stepfacts import WATCH_KEPT, Failure, StepFacts, Task
from ddpkit.launcher_output import reader_for
from ddpkit.launcher_output.torch_agent import cxx_log
from ddpkit.launcher_output.tracebacks import TRACEBACK

__all__ = ["RELEASE_S", "WATCH_KEPT", "Failure", "StepScreen"]

RELEASE_S = 15.0
HELD_MAX = 20_000
_NUMBERS = re.compile(r"0x[0-9a-f]+|\d+")


class StepScreen:
    """The job's screen for one step: lines in (``take``), what the user reads out (``out``/``err``), and the facts
    a digest needs (``digest``). Pure apart from the streams it writes to."""

    def __init__(self, out: TextIO, err: TextIO, *, agents: bool | None = None, ranks_per_task: int | None = None,
                 release_s: float = RELEASE_S, launcher: str = "srun", show_all: bool = False) -> None:
        """``agents``: whether each task is a torchrun agent (True) or a rank (False); None: from their lines.
        ``ranks_per_task``: torchrun's --nproc-per-node (None: from the ranks' lines). ``launcher``: the program
        whose lines come in: ``srun`` (labelled by ``--label``, one task per line's label), ``mpirun`` (Open MPI's
        --tag-output), ``mpich`` (-prepend-rank) or another (a rendered torchrun job: one unlabelled stream, the
        agent's). ``show_all``: every line shown as it came (where the output is the only full log, a Kubernetes
        pod's): the screen only reads them, for the digest."""
        self._out, self._err = out, err
        self._reader = reader_for(launcher)
        self.facts = StepFacts(self._reader, agents=agents, ranks_per_task=ranks_per_task)
        self._show_all = show_all
        self._release_s = release_s
        self._pending: float | None = None
        self._held: deque[str] = deque(maxlen=HELD_MAX)
        self._kinds: set[str] = set()

    @property
    def tasks(self) -> dict[int, Task]:
        return self.facts.tasks

    @property
    def watch(self) -> list[tuple[int, str]]:
        return self.facts.watch

    @property
    def failing(self) -> bool:
        return self.facts.failing

    def take(self, line: str, *, to_stderr: bool, now: float | None = None) -> None:
        """One whole line the launcher wrote (with srun's ``--label``, ``T: ...``; unlabelled lines are srun's
        own)."""
        reading = self._reader.read(line)
        task = self.facts.line(reading)
        text = reading.text
        if self._show_all:
            if to_stderr:
                task.stderr.append(text)
            self._show(self._err if to_stderr else self._out, line)
            return
        if is_noise(text) or text.strip() == "<omitting python frames>" or reading.quiet:
            return  # torch's C++ frames; the frame of mpirun's boxes (their words are shown, or held)
        if not to_stderr:
            self._show(self._out, text)
            return
        task.stderr.append(text)
        cxx = cxx_log(text)
        if cxx is not None:
            kind = _NUMBERS.sub("N", re.sub(r"\(.*\)|\[[^\]]*\]", "", cxx))
            if not self.failing and kind not in self._kinds:
                self._kinds.add(kind)
                self._show(self._err, text)
            return
        if self._duplicate_error(task, text):
            return
        if not self.failing and self._pending is None and text.strip() == TRACEBACK:
            self._pending = time.monotonic() if now is None else now
        if self.failing or self._pending is not None:
            self._held.append(text)
        else:
            self._show(self._err, text)

    def tick(self, now: float | None = None) -> None:
        """Show what was held when no failure followed a traceback within ``release_s`` (a handled one)."""
        now = time.monotonic() if now is None else now
        if not self.failing and self._pending is not None and now - self._pending > self._release_s:
            self.release()

    def release(self) -> None:
        for text in self._held:
            self._show(self._err, text)
        self._held.clear()
        self._pending = None

    def digest(self, code: int, log: str) -> list[str]:
        """The failed step on one screen, cause first (``StepFacts.digest``)."""
        return self.facts.digest(code, log)

    def _duplicate_error(self, task: Task, text: str) -> bool:
        """A ``ddpkit: error:`` block (its first line and the indented lines under it) another task already
        printed: every rank that checks the same input says the same."""
        if text.startswith("ddpkit: error:"):
            task.quiet_block = text in self.facts.errors
            self.facts.errors.add(text)
            return task.quiet_block
        if task.quiet_block and text.startswith(" "):
            return True
        task.quiet_block = False
        return False

    def _show(self, stream: TextIO, text: str) -> None:
        stream.write(text + "\n")
        stream.flush()
