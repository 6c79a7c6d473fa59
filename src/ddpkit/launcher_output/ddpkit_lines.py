"""ddpkit's own words in a launcher's output, whichever launcher carries them: a logger's ``[host:rank] `` prefix
and the watch's report (its headline, the lines under it, the ranks it says stopped answering).

They are read here, once, for the digest and for heal alike; no decision elsewhere reads them back."""

from __future__ import annotations

import re

from ddpkit.launcher_output.events import Event, RankOnHost, SilentRank, WatchLine

__all__ = ["WATCH", "WatchReader", "logged_below_error", "logged_error", "rank_prefix", "silent_ranks"]

WATCH = "ddpkit watch:"
_PREFIX = re.compile(r"^\[([^\]:\s]+):(\d+)\] ")
#: a ddpkit logger's line below error level ("[vm:1] WARNING ...", "[vm:-] INFO ..." before the rank is known)
_BELOW_ERROR = re.compile(r"^\[[^\]\s]+:(?:\d+|-)\] (?:DEBUG|INFO|WARNING) ")
#: a ddpkit rank's logged error ("[host:3] ERROR rank 3: ..."): its words where it printed no traceback
_ERROR = re.compile(r"^\[[^\]\s]+:\d+\] (?:ERROR|CRITICAL) ")
#: the watch's words for a rank whose heartbeat stopped: "rank 1 on host node2 (pid 8857) stopped answering"
_SILENT = re.compile(r"rank (\d+) on host (\S+?)(?: \(pid (\d+)\))? stopped answering")


def rank_prefix(text: str) -> RankOnHost | None:
    """The ``[host:rank] `` a ddpkit logger puts before a rank's line."""
    found = _PREFIX.match(text)
    return RankOnHost(rank=int(found[2]), host=found[1]) if found else None


def logged_below_error(text: str) -> bool:
    return bool(_BELOW_ERROR.match(text))


def logged_error(text: str) -> str | None:
    """The words of a rank's logged error, without the logger's prefix; None for any other line."""
    found = _ERROR.match(text)
    return text[found.end():] if found else None


def silent_ranks(text: str) -> list[SilentRank]:
    """Each rank ``text`` says stopped answering (a headline may name several)."""
    return [SilentRank(rank=int(m[1]), host=m[2], pid=int(m[3]) if m[3] else None, line=text.strip(),
                       headline=WATCH in text) for m in _SILENT.finditer(text)]


class WatchReader:
    """The watch's report, source by source: a headline opens it, the lines under it (indented, or its "---"
    rule) go on, any other line of that source ends it."""

    def __init__(self) -> None:
        self._open: set[int | None] = set()

    def read(self, source: int | None, text: str) -> list[Event]:
        if text.startswith(WATCH):
            self._open.add(source)
        elif not text.startswith((" ", "---")):
            self._open.discard(source)
        found: list[Event] = []
        if source in self._open:
            found.append(WatchLine(text=text, headline=text.startswith(WATCH)))
        found += silent_ranks(text)
        return found
