"""A Python traceback in what a rank printed: where the last one begins, its frames and its exception's lines
(``last_traceback``, for the digest a person reads), its exception's first line (``exception_line``, for the
classification), and the ``RankTraceback`` event a rank's own lines make."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ddpkit.launcher_output.events import RankTraceback

__all__ = ["CHAINED", "COMPILE_ERROR", "TRACEBACK", "exception_line", "last_traceback", "rank_traceback"]

TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
#: a script that did not compile: Python prints where (no frames, no "Traceback" line), then the error
_COMPILE_WHERE = re.compile(r'^  File "[^"]+", line \d+$')
COMPILE_ERROR = re.compile(r"^(?:SyntaxError|IndentationError|TabError)\b")
#: how much of an exception's line the classification keeps
EXCEPTION_MAX = 200


def _last_start(lines: Sequence[str]) -> int | None:
    return max((i for i, line in enumerate(lines) if line.strip() == TRACEBACK), default=None)


def _logged(line: str) -> bool:
    """A line some logger wrote, with its prefix ("[host:rank] WARNING ...", torch's "[rank3]:[W1126 ...]")."""
    return line.startswith("[")


def last_traceback(text: str) -> tuple[list[str], list[str]] | None:
    """The last Python traceback in ``text``: its frames (``File ...`` lines each with the source lines under it)
    flattened, and the exception's lines; None when there is none. A chained traceback counts from its last part;
    a script that did not compile, from Python's words on where."""
    lines = text.splitlines()
    start = _last_start(lines)
    if start is None:
        return _compile_error(lines)
    frames: list[str] = []
    exception: list[str] = []
    for line in lines[start + 1:]:
        if not exception and line.startswith(" "):
            frames.append(line)
        elif not line.strip() or line.startswith(CHAINED) or line.strip() == TRACEBACK:
            if exception:
                break
        elif exception and _logged(line):
            break
        else:
            exception.append(line)
            if len(exception) == 3:
                break
    return frames, exception


def _compile_error(lines: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """The last error of a script that did not compile (Python's own words: ``File "x.py", line 3``, the source
    line, a caret, ``SyntaxError: expected ':'``), as a traceback of that one frame; None where there is none."""
    for i in range(len(lines) - 1, -1, -1):
        if not _COMPILE_WHERE.match(lines[i]):
            continue
        end = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith(" ")), len(lines))
        if end < len(lines) and COMPILE_ERROR.match(lines[end]):
            return list(lines[i:end]), [lines[end]]
    return None


def exception_line(text: str) -> str | None:
    """The exception of the last Python traceback in ``text`` (a rank's stderr): the first line after its frames
    (``ValueError: bad batch``), cut to ``EXCEPTION_MAX`` characters; None when there is no traceback."""
    lines = text.splitlines()
    start = _last_start(lines)
    if start is None:
        return None
    for line in lines[start + 1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            said = line.strip()
            return said if len(said) <= EXCEPTION_MAX else said[:EXCEPTION_MAX - 3] + "..."
    return None


def rank_traceback(rank: int, host: str | None, lines: Sequence[str]) -> RankTraceback | None:
    """The event of a rank's last traceback among its own ``lines``; None where it printed none."""
    said = exception_line("\n".join(lines))
    if said is None:
        return None
    own = list(lines)[_last_start(lines) or 0:]
    frames, _ = last_traceback("\n".join(own)) or ([], [])
    return RankTraceback(rank=rank, host=host, exception=said, frames=tuple(frames), text="\n".join(own))
