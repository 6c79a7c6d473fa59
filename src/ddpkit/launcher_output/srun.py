"""srun's output with ``--label``: each task's lines as ``T: text``, srun's own unlabelled: a task that ended badly
(``srun: error: node2: task 1: Killed``, ``... tasks 0-1: Exited with exit code 3``) and its word that it is
ending the step (after which a task's end is srun's doing: ``--kill-on-bad-exit``, a cancel)."""

from __future__ import annotations

import re

from ddpkit.launcher_output.events import Event, StepEnding, TasksEnded
from ddpkit.launcher_output.reader import Reader
from ddpkit.launcher_output.words import SRUN_SIGNALS, task_ids

__all__ = ["SrunReader"]

_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")
_TASKS_ENDED = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_EXITED = re.compile(r"Exited with exit code (\d+)")
#: srun (or slurmstepd) ending the step
_ENDING = ("Terminating StepId", "Force Terminated", "CANCELLED AT", "Job step aborted")


class SrunReader(Reader):
    name = program = "srun"
    unit = "job step"
    logs_of = "every node and rank"
    localhost_is_here = False

    def __init__(self) -> None:
        super().__init__()
        self.ending = False
        """srun said it is ending the step."""

    def _label(self, line: str) -> tuple[int | None, str]:
        found = _LABEL.match(line)
        return (int(found[1]), found[2]) if found else (None, line)

    def _own(self, source: int | None, text: str, line: str) -> list[Event]:
        found: list[Event] = []
        if any(words in text for words in _ENDING):
            self.ending = True
            found.append(StepEnding(text=text.strip()))
        ended = _TASKS_ENDED.match(line) if source is None else None
        if ended:
            what = ended[3].strip()
            code = _EXITED.search(what)
            sig = next((int(s) for word, s in SRUN_SIGNALS.items() if what.startswith(word)), None)
            found.append(TasksEnded(tasks=tuple(task_ids(ended[2])), host=ended[1],
                                    exit_code=int(code[1]) if code else None, signal=None if code else sig,
                                    after_step_ending=self.ending))
        return found
