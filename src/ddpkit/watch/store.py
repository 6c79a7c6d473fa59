"""The job's store as the watch uses it: every call bounded in time.

torch's TCPStore client does not apply its timeout while the server's host does not answer: with the store's
process stopped (SIGSTOP) or its host cut off, ``check``, ``get``, ``multi_get``, ``compare_set``, ``add`` and
even ``wait`` stayed blocked past 15 s with a 2 s timeout (measured here, torch 2.13; ``set`` returns at once: it
expects no reply). A watch thread blocked there could never report that it lost the store. So every call runs on
one worker thread of this wrapper and the caller waits at most ``limit`` seconds; while a call that overran is
still blocked, later calls fail at once (they would queue behind it). When it returns, the store is used again.

A connection the store's host closed (it exited: rank 0 hosts the store under env:// and ddpkit's agent) is not
used again: every call on it failed, and each failure printed a warning with a page of torch's C++ frames
("sendBytes failed ... Broken pipe", every heartbeat). Later calls fail at once, in Python.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["BoundedStore", "StoreUnanswered", "agent_store"]


class StoreUnanswered(RuntimeError):
    """The job's store did not answer within the limit."""


class _Call:
    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class BoundedStore:
    """``store``'s methods, each waiting at most ``limit`` s for the answer (see the module's text)."""

    def __init__(self, store: Any, limit: float) -> None:
        self._store = store
        self.limit = limit
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._overran: _Call | None = None
        self._broken: BaseException | None = None
        # a daemon thread: one blocked for good in the store must not keep the process from ending
        threading.Thread(target=self._serve, name="ddpkit-watch-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            try:
                call.value = call.fn(*call.args)
            except BaseException as exc:  # handed to the caller
                call.error = exc
            call.done.set()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def bounded(*args: Any) -> Any:
            stuck = self._overran
            if stuck is not None and not stuck.done.is_set():
                raise StoreUnanswered(f"the job's store has not answered for over {self.limit:g} s")
            if self._broken is not None:
                raise StoreUnanswered(f"the connection to the job's store is closed ({self._broken})")
            call = _Call(method, args)
            self._calls.put(call)
            if not call.done.wait(self.limit):
                self._overran = call
                raise StoreUnanswered(f"the job's store did not answer within {self.limit:g} s")
            if call.error is not None:
                if _connection_lost(call.error):
                    self._broken = call.error
                raise call.error
            return call.value

        return bounded


def _connection_lost(error: BaseException) -> bool:
    """torch's network error on a store call (``DistNetworkError``: the peer closed the socket, a broken pipe), told
    apart from a key's timeout, which leaves the connection usable."""
    return any(kind.__name__ == "DistNetworkError" for kind in type(error).__mro__)


#: This process's connection to the live agent's store, by (pid, host, port): made once (``agent_store``).
_AGENT_STORES: dict[tuple[int, str, int], Any] = {}


def agent_store(host: str, port: int, timeout: timedelta) -> Any:
    """This process's one connection to ddpkit's live agent's store (``--heal live``), shared by the watch and the
    rank's live group (``live.rank.group``; ``timeout``: the first caller's). Each connection more, made while a
    node's replacements start together, was answered 5.0 s late on this machine: the watch's own, in 2 of 3 drills
    of 4 ranks replaced at once (bench_live_heal_growth). A TCPStore client runs one call at a time, and both make
    short ones. A forked child makes its own (the key holds the process id)."""
    import torch.distributed as dist

    key = (os.getpid(), host.strip("[]"), port)  # an IPv6 address as TCPStore takes it, without its brackets
    if key not in _AGENT_STORES:
        _AGENT_STORES[key] = dist.TCPStore(key[1], port, is_master=False, timeout=timeout, wait_for_workers=False)
    return _AGENT_STORES[key]
