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

__all__ = ["CHAINED", "RankEnd", "cause", "digest", "is_noise", "last_traceback", "own_lines", "rank_list", "said",
           "short", "watch_report"]

TRACEBACK = "Traceback (most recent call last):"
WATCH = "ddpkit watch:"
#: torch's C++ stack frames and the line that opens them: hundreds of lines a failure, none of them the user's
_NOISE = re.compile(r"^\s*(frame #\d+:|Exception raised from .* \(most recent call first\):$)")
#: where gloo's C++ raised ("[/__w/pytorch/.../pair.cc:553] ") and which peer address: they differ rank by rank
_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|c|h|hpp):\d+\]\s*")
_ADDRESS = re.compile(r"\s*(?:\[[0-9A-Fa-f.:]+\]|\d{1,3}(?:\.\d{1,3}){3}):\d+")
_LIBRARY = ("/site-packages/", "/dist-packages/", "/ddpkit/", "/lib/python3")
_RANK = re.compile(r"\brank \d+\b")
#: a script that did not compile: Python prints where (no frames, no "Traceback" line), then the error
_COMPILE_WHERE = re.compile(r'^  File "[^"]+", line \d+$')
_COMPILE_ERROR = re.compile(r"^(?:SyntaxError|IndentationError|TabError)\b")
#: the caret line under a source line: where the parser stopped
_CARET = re.compile(r"^\s*[~^]+\s*$")
#: start-up noise on a rank's stderr, none of it the rank's own words: a library's Python warning (its path under
#: site-packages, then the source line under it), torch's C++ log lines ("[W1128 00:55:38.789000 5497 ...]",
#: "[rank1]:[W1128 ...]"), and ddpkit's own log lines below error level ("[vm:1] WARNING ...")
_LIBRARY_WARNING = re.compile(r"^(?P<path>\S+\.py):\d+: \w*Warning: ")
_CPP_LOG = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} \d\d:\d\d:\d\d")
_DDPKIT_LOG = re.compile(r"^\[[^\]\s]+:(?:\d+|-)\] (?:DEBUG|INFO|WARNING) ")
#: a ddpkit rank's logged error ("[host:3] ERROR rank 3: ..."): its words where it printed no traceback
_ERROR_LOGGED = re.compile(r"^\[[^\]\s]+:\d+\] (?:ERROR|CRITICAL) ")
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
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


def is_noise(line: str) -> bool:
    """A line kept off the screen (it stays in the rank's log file): torch's C++ frames."""
    return bool(_NOISE.match(line))


def _logged(line: str) -> bool:
    """A line some logger wrote, with its prefix ("[host:rank] WARNING ...", torch's "[rank3]:[W1126 ...]")."""
    return line.startswith("[")


def last_traceback(text: str) -> tuple[list[str], list[str]] | None:
    """The last Python traceback in ``text``: its frames (``File ...`` lines each with the source lines under it)
    flattened, and the exception's lines; None when there is none. A chained traceback counts from its last part."""
    lines = text.splitlines()
    start = max((i for i, line in enumerate(lines) if line.strip() == TRACEBACK), default=None)
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
        if end < len(lines) and _COMPILE_ERROR.match(lines[end]):
            return list(lines[i:end]), [lines[end]]
    return None


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
        if under_warning or not line.strip() or is_noise(line) or _CPP_LOG.match(line) or _DDPKIT_LOG.match(line):
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


def _signal_name(code: int) -> str:
    return signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"


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
        return f"killed by {_signal_name(end.exitcode)}" + (f"; the kernel: {end.kernel}" if end.kernel else "")
    if end.exitcode:
        return f"exit code {end.exitcode}"
    logged = [line for line in end.stderr.splitlines() if _ERROR_LOGGED.match(line)]
    if logged:
        return short(_ERROR_LOGGED.sub("", logged[-1]))
    if end.ended_by == signal.SIGKILL:
        return "killed by the agent (SIGKILL): still running after SIGTERM and its grace period"
    if end.ended_by is not None:
        return f"ended by the agent ({_signal_name(-end.ended_by)})" + \
            (f" after rank {first} failed" if first is not None else "")
    return "its exit code not reported, no error on its stderr"


def cause(end: RankEnd) -> list[str]:
    """The first failing rank's own words: the user's frame and the exception, else its last lines on stderr."""
    if end.kernel:
        return [f"the kernel: {end.kernel}", *cause(RankEnd(rank=end.rank, stderr=end.stderr))]
    found = last_traceback(end.stderr)
    if found and found[1]:
        frames, exception = found
        return [*_user_frame(frames, caret=bool(_COMPILE_ERROR.match(exception[0]))), *exception]
    tail = own_lines(end.stderr)[-3:]
    if tail:
        return tail
    out = own_lines(end.stdout)[-3:]
    return ["its last lines on stdout:", *(f"  {line}" for line in out)] if out \
        else ["(nothing on its stderr)"]


def rank_list(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0-10, 12-15``."""
    ordered = sorted(set(ranks))
    spans: list[list[int]] = []
    for r in ordered:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    words = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ordered) > 1 else ''} {words}"


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
