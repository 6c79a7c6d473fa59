"""The watch's wrappers kept out of what a user reads: a rank's stacks and an exception's traceback show the user's
frames and torch's, never the watch's ``hooks.py`` and ``p2p.py`` (the functions it puts in torch's place: every
collective, point-to-point call, ``Work.wait`` and DDP forward of the script passes through one).

A traceback is relinked (``tb_next`` is writable): each wrapper takes the entries out before its bare ``raise``
(the user's own ``except`` sees the exception clean), and the exception leaving the user's code (``note_exception``,
the watch's ``sys.excepthook``) is cleaned once more, for the entries a Python older than 3.11 puts back on a bare
``raise``. An exception raised by a wrapper's own code (a fault of the watch) keeps its frames.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from types import TracebackType

__all__ = ["hide_wrappers", "is_wrapper", "user_frames"]

_HERE = os.path.dirname(__file__)  # as p2p.py names its generated functions
#: The watch's wrappers of torch's functions; ``p2p.py`` also names the per-call functions it compiles
#: (``p2p.py (recv, generated)``).
_WRAPPERS = (os.path.join(_HERE, "hooks.py"), os.path.join(_HERE, "p2p.py"))
#: A wrapper's line that calls the function it wraps (``original(...)``; the user's comm hook: ``hook(...)``).
_CALL = re.compile(r"\b(original|hook)\(")


def is_wrapper(filename: str) -> bool:
    """Whether a frame of this file is one of the watch's wrappers."""
    return filename.startswith(_WRAPPERS)


def user_frames(frames: traceback.StackSummary | list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """A stack without the watch's wrappers."""
    return [f for f in frames if not is_wrapper(f.filename)]


def _ours(tb: TracebackType) -> bool:
    return is_wrapper(tb.tb_frame.f_code.co_filename)


def _calls_through(tb: TracebackType) -> bool:
    """Whether a wrapper's entry is at its call of the function it wraps (torch's, or the user's comm hook): what
    raised there was raised by that function (torch's, written in C, leaves no entry of its own)."""
    return _CALL.search(linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)) is not None


def hide_wrappers(exc: BaseException | None) -> None:
    """Take the watch's wrappers out of ``exc``'s traceback, and out of those of the exceptions it was raised from
    or during, in place. An exception raised by a wrapper's own code (its innermost entry a wrapper's, not at its call
    of the function it wraps: a fault of the watch) keeps its frames. Quick: on an exception's path only."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        head = last = exc.__traceback__
        while last is not None and last.tb_next is not None:
            last = last.tb_next
        if last is not None and (not _ours(last) or _calls_through(last)):
            while head is not None and _ours(head):
                head = head.tb_next
            tb = head
            while tb is not None:
                after = tb.tb_next
                while after is not None and _ours(after):
                    after = after.tb_next
                if after is not tb.tb_next:
                    tb.tb_next = after
                tb = after
            if head is not exc.__traceback__:
                exc.__traceback__ = head
        exc = exc.__cause__ or exc.__context__
