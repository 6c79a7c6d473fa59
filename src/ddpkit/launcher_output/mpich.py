"""MPICH's ``mpiexec -prepend-rank``: each rank's lines as ``[R] text``. Its exit names no rank that failed, so the
digest names the rank whose own traceback came first (``names_failures``)."""

from __future__ import annotations

import re

from ddpkit.launcher_output.reader import Reader

__all__ = ["MpichReader"]

_TAG = re.compile(r"^\[(\d+)\] ?(.*)$")


class MpichReader(Reader):
    name = "mpich"
    program = "mpiexec"
    logs_of = "every node and rank"
    names_failures = False

    def _label(self, line: str) -> tuple[int | None, str]:
        found = _TAG.match(line)
        return (int(found[1]), found[2]) if found else (None, line)
