"""Never a silent hang: every phase of the check runs under a deadline that every rank enforces.

Each rank publishes its progress in rank 0's store (``phase/<rank>`` = ``<index> <name> in|done``). A watchdog
thread per rank, on its own store connection (the main thread may be blocked inside a store call or a
collective), polls twice as fast as it must:

- when this rank's current phase passes its deadline, it reads every rank's progress, writes the diagnosis
  (which phase, which ranks had not reached it, which were in it but not done) to the ``abort`` key
  (first writer wins);
- when ``abort`` is set, rank 0 prints the diagnosis, every rank dumps its Python stacks to stderr and exits
  with code 3 (``os._exit``: a thread blocked in C cannot stop the process from ending).

A ``faulthandler.dump_traceback_later`` per phase is the backstop for a rank whose interpreter is wedged (the
watchdog thread cannot run): it dumps the stacks and ends the process (exit code 1) a few seconds later.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ddpkit.errors import EXIT_MISSING
from ddpkit.log import get_logger

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["Watchdog", "diagnose"]

log = get_logger(__name__)
POLL_S = 0.1
ACK_WAIT_S = 3.0  # how long rank 0 (which may host the store) waits for the others to see the abort
REPORT_WAIT_S = 10.0  # how long the others give rank 0 to print the diagnosis before they exit
BACKSTOP_S = 10.0  # the faulthandler backstop fires this long after a phase's deadline


def diagnose(phase_index: int, phase: str, seconds: float, reporter: int, progress: dict[int, str | None]) -> str:
    """The sentence rank 0 prints when ``phase`` (the ``phase_index``-th) passed its deadline on ``reporter``."""
    behind, inside = [], []
    for rank, state in sorted(progress.items()):
        if state is None:
            behind.append(f"rank {rank} (never checked in)")
            continue
        idx_text, name, how = state.split(" ")
        idx = int(idx_text)
        if idx < phase_index:
            behind.append(f"rank {rank} (last: {name} {'done' if how == 'done' else 'in progress'})")
        elif idx == phase_index and how == "in":
            inside.append(rank)
    parts = [f"phase '{phase}' passed its {seconds:g} s deadline on rank {reporter}"]
    parts.append(f"ranks that had not reached it: {', '.join(behind)}" if behind else
                 "every rank had reached it")
    if inside:
        parts.append(f"ranks in it and not done: {inside}")
    return "; ".join(parts)


class Watchdog:
    """Deadlines for the phases of one run; ``on_abort(reason)`` runs on rank 0 before the process exits."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int,
                 on_abort: Callable[[str], object] | None = None) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.on_abort = on_abort
        self.index = -1
        self.current: tuple[int, str, float, float] | None = None  # index, name, seconds, deadline (monotonic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddpkit-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()

    @contextmanager
    def phase(self, name: str, seconds: float, *, mark: Callable[[str], None]) -> Iterator[None]:
        """Run the body under a ``seconds`` deadline. ``mark(value)`` publishes progress (the main store's set)."""
        self.index += 1
        index = self.index
        mark(f"{index} {name} in")
        self.current = (index, name, seconds, time.monotonic() + seconds)
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            self.current = None
            mark(f"{index} {name} done")

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if self.store.check(["abort"]):
                    self._abort(self.store.get("abort").decode())
                current = self.current
                if current is not None and time.monotonic() > current[3]:
                    self._expire(*current[:3])
            except Exception as exc:  # the store went away: rank 0 ended; nothing to coordinate with any more
                if self._stop.is_set():
                    return
                self._die(f"lost rank 0's store while checking deadlines ({exc})")

    def _expire(self, index: int, name: str, seconds: float) -> None:
        keys = [f"phase/{r}" for r in range(self.world_size)]
        progress = {r: (self.store.get(k).decode() if self.store.check([k]) else None) for r, k in enumerate(keys)}
        reason = diagnose(index, name, seconds, self.rank, progress)
        self.store.compare_set("abort", "", reason)

    def _abort(self, reason: str) -> None:
        """Rank 0 reports first; the others dump their stacks and leave; rank 0 (it may host the store, and a rank
        that loses the store cannot tell an abort from a crash) leaves last. Each wait is bounded."""
        log.debug("rank %d saw the abort", self.rank)
        if self.rank == 0:
            if self.on_abort is not None:
                self.on_abort(reason)
            self._dump_stacks(reason)
            self.store.set("abort/reported", "1")
            others = sum(self.store.check([f"phase/{r}"]) for r in range(1, self.world_size))
            deadline = time.monotonic() + ACK_WAIT_S
            while time.monotonic() < deadline and int(self.store.add("abort/done", 0)) < others:
                time.sleep(POLL_S / 2)
        else:  # under torch elastic our exit makes the agent stop rank 0: let it finish its report first
            deadline = time.monotonic() + REPORT_WAIT_S
            try:
                while time.monotonic() < deadline and not self.store.check(["abort/reported"]):
                    time.sleep(POLL_S / 2)
                self._dump_stacks(reason)
                self.store.add("abort/done", 1)
            except Exception:  # rank 0 reported and left, taking its store along
                self._dump_stacks(reason)
        os._exit(EXIT_MISSING)

    def _die(self, reason: str) -> None:
        self._dump_stacks(reason)
        os._exit(EXIT_MISSING)

    def _dump_stacks(self, reason: str) -> None:
        where = f"in phase '{self.current[1]}'" if self.current else "between phases"
        sys.stdout.flush()
        print(f"ddpkit check: rank {self.rank} (pid {os.getpid()}) aborting {where}: {reason}\n"
              f"ddpkit check: rank {self.rank} Python stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
