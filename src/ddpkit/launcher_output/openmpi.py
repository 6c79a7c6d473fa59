"""Open MPI's ``mpirun --tag-output``: each rank's lines as ``[J,R]<stderr>:text``; mpirun's own unlabelled: its
box on the first process with a non-zero exit code ("Process name: [[J,1],R]", then "Exit code: N"), its line on a
process a signal ended ("mpirun noticed that process rank R with PID P on node H exited on signal S"), and its
words that the job failed. The frame of its boxes (a rule of dashes) says nothing."""

from __future__ import annotations

import re

from ddpkit.launcher_output.events import Event, JobFailing, RankEnded
from ddpkit.launcher_output.reader import Reader

__all__ = ["OpenMpiReader"]

_TAG = re.compile(r"^\[\d+,(\d+)\]<std(?:out|err)>: ?(.*)$")
_FIRST = re.compile(r"^\s*Process name: \[\[\d+,\d+\],(\d+)\]")
_EXIT = re.compile(r"^\s*Exit code:\s+(-?\d+)")
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_FAILED = ("Primary job  terminated normally", "mpirun detected that one or more processes")
_RULE = re.compile(r"-{20,}")


class OpenMpiReader(Reader):
    name = program = "mpirun"
    logs_of = "every node and rank"

    def __init__(self) -> None:
        super().__init__()
        self._first: int | None = None

    def _label(self, line: str) -> tuple[int | None, str]:
        found = _TAG.match(line)
        return (int(found[1]), found[2]) if found else (None, line)

    def _quiet(self, source: int | None, text: str) -> bool:
        return source is None and bool(_RULE.fullmatch(text.strip()))

    def _own(self, source: int | None, text: str, line: str) -> list[Event]:
        if source is not None:
            return []
        found: list[Event] = [JobFailing(text=text)] if any(words in text for words in _FAILED) else []
        first = _FIRST.match(text)
        if first:
            self._first = int(first[1])
            return found
        code = _EXIT.match(text)
        if code and self._first is not None:
            found.append(RankEnded(rank=self._first, exit_code=int(code[1])))
            self._first = None
            return found
        killed = _SIGNALLED.search(text)
        if killed:
            found.append(RankEnded(rank=int(killed[1]), host=killed[2], signal=int(killed[3])))
        return found
