"""A failed attempt on one screen, cause first: what the rank that failed first said (its exception and the user's
frame above it, or its last lines), the other ranks' words collapsed ("ranks 0-10, 12-15: RuntimeError: ..."), the
watch's report, and where every rank's full output is. Pure: per-rank log texts and exits in, screen lines out
(``ddpkit.launch.ranklogs`` reads the files and prints)."""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ddpkit.base.errors import EXIT_MISSING
from ddpkit.launcher_output.ddpkit_lines import WATCH, logged_below_error, logged_error
from ddpkit.launcher_output.torch_agent import is_cxx_frame as is_noise
from ddpkit.launcher_output.tracebacks import CHAINED, COMPILE_ERROR, TRACEBACK, last_traceback
from ddpkit.launcher_output.words import rank_list, signal_name

__all__ = ["CHAINED", "TRACEBACK", "WATCH", "RankEnd", "cause", "digest", "is_noise", "last_traceback", "own_lines",
           "rank_list", "said", "short", "watch_report"]

#: where gloo's C++ raised ("[/__w/pytorch/.../pair.cc:553] ") and which peer address: they differ rank by rank
_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|c|h|hpp):\d+\]\s*")
_ADDRESS = re.compile(r"\s*(?:\[[0-9A-Fa-f.:]+\]|\d{1,3}(?:\.\d{1,3}){3}):\d+")
_LIBRARY = ("/site-packages/", "/dist-packages/", "/ddpkit/", "/lib/python3")
_RANK = re.compile(r"\brank \d+\b")
#: the caret line under a source line: where the parser stopped
_CARET = re.compile(r"^\s*[~^]+\s*$")
#: start-up noise on a rank's stderr, none of it the rank's own words: a library's Python warning (its path under
#: site-packages, then the source line under it), torch's C++ log lines ("[W1128 00:55:38.789000 5497 ...]",
#: "[rank1]:[W1128 ...]"), and ddpkit's own log lines below error level ("[vm:1] WARNING ...": ``logged_below_error``)
_LIBRARY_WARNING = re.compile(r"^(?P<path>\S+\.py):\d+: \w*Warning: ")
_CPP_LOG = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} \d\d:\d\d:\d\d")
SAID_MAX = 160


@dataclass(frozen=True, kw_only=True)
class RankEnd:
    """How one rank of the attempt ended, as the agent saw it and as its stderr says."""

    rank: int
    exitcode: int | None = None
    """Its exit code where the launcher reported it among the failures (negative: the signal); None: not reported
    (torch's forked workers report only the first rank to exit; the others were ended with the attempt)."""
    pid: int | None = None
    stderr: str = ""
    """The end of its stderr log."""
    stdout: str = ""
    """The end of its stdout log: its own last lines where its stderr holds none (a rank killed mid-run)."""
    kernel: str = ""
    """The kernel's line about its end (the OOM killer's, ``ddpkit.launch.kernlog``) where the log was read."""
    ended_by: int | None = None
    """The signal the launcher sent it to end the attempt, as the launcher logged it: SIGTERM, then SIGKILL where
    the rank still ran after the grace period; None: none was seen."""


def _user_frame(frames: Sequence[str], *, caret: bool = False) -> list[str]:
    """The last frame in the user's code (not in torch, ddpkit or Python's library), with its source line (and,
    with ``caret``, the caret under it, as Python prints a SyntaxError); the last frame where every frame is a
    library's."""
    starts = [i for i, line in enumerate(frames) if line.lstrip().startswith("File ")]
    if not starts:
        return []
    user = [i for i in starts if not any(part in frames[i] for part in _LIBRARY)]
    i = (user or starts)[-1]
    source = frames[i + 1] if i + 1 < len(frames) and not frames[i + 1].lstrip().startswith(("File ", "^", "~")) \
        else None
    if not source:
        return [frames[i].strip()]
    shown = [frames[i].strip(), f"  {source.strip()}"]
    under = frames[i + 2] if i + 2 < len(frames) else ""
    if caret and _CARET.match(under):  # the caret keeps its column under the source line
        indent = len(source) - len(source.lstrip())
        shown.append(f"  {under[indent:].rstrip()}")
    return shown


def own_lines(text: str) -> list[str]:
    """The lines of a rank's output that are its own: without torch's C++ frames, a library's warnings (with the
    source line under each), torch's C++ log lines and ddpkit's own log lines below error level."""
    out: list[str] = []
    under_warning = False
    for line in text.splitlines():
        if under_warning and line.startswith((" ", "\t")):
            continue
        warning = _LIBRARY_WARNING.match(line)
        under_warning = bool(warning and any(part in warning["path"] for part in _LIBRARY))
        if under_warning or not line.strip() or is_noise(line) or _CPP_LOG.match(line) or logged_below_error(line):
            continue
        out.append(line)
    return out


def short(text: str) -> str:
    """An exception's line without what differs rank by rank (gloo's C++ source location, the peer's address),
    cut to its first sentence where long."""
    text = _ADDRESS.sub("", _SOURCE.sub("", text)).strip()
    if len(text) > SAID_MAX and ". " in text:
        text = text.split(". ", 1)[0] + "."
    return text if len(text) <= SAID_MAX else text[:SAID_MAX - 3] + "..."


def said(end: RankEnd, first: int | None) -> str:
    """What one of the other ranks says, in words that are the same for every rank that says the same."""
    if end.exitcode == -signal.SIGTERM:
        return "ended by the agent (SIGTERM)" + (f" after rank {first} failed" if first is not None else "")
    if end.exitcode == EXIT_MISSING:
        return f"stopped by ddpkit (exit {EXIT_MISSING})"
    found = last_traceback(end.stderr)
    if found and found[1]:
        return short(found[1][0])
    if end.exitcode is not None and end.exitcode < 0:
        return f"killed by {signal_name(-end.exitcode)}" + (f"; the kernel: {end.kernel}" if end.kernel else "")
    if end.exitcode:
        return f"exit code {end.exitcode}"
    logged = [error for line in end.stderr.splitlines() if (error := logged_error(line)) is not None]
    if logged:
        return short(logged[-1])
    if end.ended_by == signal.SIGKILL:
        return "killed by the agent (SIGKILL): still running after SIGTERM and its grace period"
    if end.ended_by is not None:
        return f"ended by the agent ({signal_name(end.ended_by)})" + \
            (f" after rank {first} failed" if first is not None else "")
    return "its exit code not reported, no error on its stderr"


def cause(end: RankEnd) -> list[str]:
    """The first failing rank's own words: the user's frame and the exception, else its last lines on stderr."""
    if end.kernel:
        return [f"the kernel: {end.kernel}", *cause(RankEnd(rank=end.rank, stderr=end.stderr))]
    found = last_traceback(end.stderr)
    if found and found[1]:
        frames, exception = found
        return [*_user_frame(frames, caret=bool(COMPILE_ERROR.match(exception[0]))), *exception]
    tail = own_lines(end.stderr)[-3:]
    if tail:
        return tail
    out = own_lines(end.stdout)[-3:]
    return ["its last lines on stdout:", *(f"  {line}" for line in out)] if out \
        else ["(nothing on its stderr)"]


def watch_report(lines: Iterable[tuple[int, str]], limit: int = 12) -> list[str]:
    """The watch's report among ``lines`` (rank, line): each "ddpkit watch: ..." line with the indented lines its
    rank wrote under it. The first report whole; the later ones by their first line, one for all the ranks that
    said the same (the ranks a SIGTERMed rank finds gone are mostly the ones the agent ended first); at most
    ``limit`` lines, then how many more are in the logs."""
    reports: list[tuple[int, list[str]]] = []
    open_report: dict[int, list[str]] = {}
    for rank, line in lines:
        if line.startswith(WATCH):
            open_report[rank] = [line]
            reports.append((rank, open_report[rank]))
        elif rank in open_report and line.startswith(" "):
            open_report[rank].append(line)
        else:
            open_report.pop(rank, None)
    if not reports:
        return []
    shown = list(dict.fromkeys(reports[0][1]))
    alike: dict[str, tuple[str, list[int]]] = {}
    left = 0
    for rank, report in reports[1:]:
        headline, left = report[0], left + sum(line not in shown for line in report[1:])
        if headline not in shown:
            alike.setdefault(_RANK.sub("rank R", headline, count=1), (headline, []))[1].append(rank)
    for headline, ranks in alike.values():
        shown.append(headline)
        if len(ranks) > 1:
            shown.append(f"    the same from {rank_list(ranks[1:])}")
    if len(shown) > limit:
        left += len(shown) - limit + 1
        shown = shown[:limit - 1]
    return [*shown, f"  ... {left} more lines of the watch's report in the logs"] if left else shown


def digest(ends: Sequence[RankEnd], *, first: int | None, host: str, logs: str,
           watch: Sequence[tuple[int, str]] = ()) -> list[str]:
    """The screen for a failed attempt, after the line that names the rank that failed first (``first``; None:
    ddpkit stopped the ranks, or it is not known). ``watch``: the ranks' lines (rank, line) the screen has not
    shown, where the watch's report is."""
    lines: list[str] = []
    by_rank = {end.rank: end for end in ends}
    if first is not None and first in by_rank:
        lines.append(f"  rank {first} on host {host}:")
        lines += [f"    {line}" for line in cause(by_rank[first])]
    groups: dict[str, list[int]] = {}
    for end in sorted(ends, key=lambda e: e.rank):
        if end.rank != first:
            groups.setdefault(said(end, first), []).append(end.rank)
    lines += [f"  {rank_list(ranks)}: {said}" for said, ranks in groups.items()]
    lines += [f"  {line}" for line in watch_report(watch)]
    lines.append(f"  full logs: {logs}")
    return lines
