"""A daemon thread that lasts as long as a ``with`` block: started on entry, told to stop on exit.

A daemon, so a loop blocked in a read of a store that is gone never keeps the process alive; told to stop through
an event its loop waits on (``stopping.wait(interval)``), so leaving the block ends it within one interval.
"""

from __future__ import annotations

import threading
from typing import TypeVar

__all__ = ["BackgroundLoop"]

B = TypeVar("B", bound="BackgroundLoop")


class BackgroundLoop:
    """Subclasses write ``loop()``; it should return once ``stopping`` is set."""

    def __init__(self, name: str) -> None:
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.loop, name=name, daemon=True)

    def loop(self) -> None:
        raise NotImplementedError

    def __enter__(self: B) -> B:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
