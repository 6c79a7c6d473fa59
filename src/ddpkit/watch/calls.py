"""A rank's watched calls, as the per-call path keeps them: every collective entered and completed (op, size,
sequence number, call site) and every point-to-point call posted, with the small objects the wrappers of torch's
functions (``hooks.py``, ``p2p.py``) write on each call. ``Recorder`` (``recorder.py``) is a ``Calls`` with the
rank's steps, phases and published record.

The per-call path (``enter``) runs on the rank's training thread inside every step, where Python runs 5-7 times
slower than in a tight loop (benchmarks/results/bench_watch.md), so it takes no lock and makes no record it does not
need: a call is entered by one counter write and one dict insert, and completes by leaving that dict (``dict.pop``
is atomic, so the training thread and the watch's thread may both complete calls). ``completed`` is not counted: it
is ``entered`` less the calls still open, read by the watch's thread from snapshots (``list(dict)`` is atomic).
Nothing here talks to the store (``monitor.py`` does).

Point-to-point calls (``send``, ``recv``, their async forms and ``batch_isend_irecv``) are numbered apart from the
collectives, per peer and direction (``recv #3 from rank 0`` is the third receive this rank posted for rank 0): ranks
legitimately make different numbers of them, so they take no part in the collectives' numbering, in the group's count
(``group_seq``, which gloo advances for them too) or in a desync.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpkit.watch.records import Waiting

__all__ = ["CALLERS", "Caller", "Calls", "P2PBook", "P2PCall", "Peers", "call_site", "caller", "future_error",
           "parameters", "position", "wrapper_of"]

#: A point-to-point call's ends: (``send`` or ``recv``, the peer's global rank, None for any source) per operation.
Peers = tuple[tuple[str, int | None], ...]
#: A posted point-to-point call: op, peers, its number (per peer and direction; a batch's: by batch), and where it
#: was called, as the caller's code object and instruction offset, made a ``file:line (function)`` text only when a
#: record shows the call (``site_text``); None, 0 on the per-call path, which takes no frame: the site is then the
#: line where the thread blocks, in the call or in a wait on its request (``Calls.p2p_site``).
P2PCall = tuple[str, Peers, int, Any, int]


#: Collectives kept in a record's ``recent`` list, to name a desync between ranks one or two calls apart.
RECENT = 8
_SKIP = (os.path.dirname(__file__),)  # the watch's own files (ddpkit train's are a caller like any other)


def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__)


def call_site(skip: tuple[str, ...]) -> str:
    """``file:line (function)`` of the first frame outside torch and the watch: the user's line that started the
    collective (for DDP's gradient buckets, the line that called ``backward``)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{os.path.basename(name)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]
    return "(no Python caller)"


def parameters(fn: Callable[..., Any]) -> list[str]:
    """``fn``'s parameters by name, in order; none where its signature cannot be read."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def position(fn: Callable[..., Any], name: str) -> int | None:
    """Where ``fn`` takes ``name`` among its positional arguments (None: nowhere, or its signature cannot be read)."""
    params = parameters(fn)
    return params.index(name) if name in params else None


def wrapper_of(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapper`` in torch's ``original``'s place: named as it (``functools.wraps``), and holding it
    (``_ddpkit_original``: ddpkit's own gradient hook issues its collectives through torch's, uncounted)."""
    functools.wraps(original)(wrapper)
    wrapper._ddpkit_original = original  # type: ignore[attr-defined]
    return wrapper


class P2PBook:
    """A rank's point-to-point calls as the per-call path (``p2p.point_to_point``) keeps them, in the slots of one
    small object, not among the recorder's many attributes: a call that comes cold after the step's compute reads
    fewer cache lines (benchmarks/results/bench_watch.md). The default group, once a call looked it up
    (``world``); the calls posted per peer to send and to receive (``send``, ``recv``); an async call's request (a
    ``Work``, hashed by identity) -> the call, since a wait on it is a wait in that call (``requests``: dropped once
    only this dict holds the request, ``Recorder.record``); how many calls returned (``returned``: the monitor's
    progress)."""

    __slots__ = ("recv", "requests", "returned", "send", "world")

    def __init__(self) -> None:
        self.world: Any = None
        self.send: dict[int | None, int] = {}
        self.recv: dict[int | None, int] = {}
        self.requests: dict[Any, P2PCall] = {}
        self.returned = 0


class Caller:
    """One thread on the watch's per-call path: whether it is inside a watched call (``depth``: one nested in it,
    the ``isend`` in torch's ``send``, passes through), and the point-to-point call it blocks in (``call``, None: none)
    since when. Plain slots, not a ``threading.local``, whose attribute reads and writes cost a point-to-point call
    more than its whole record."""

    __slots__ = ("call", "depth", "since")

    def __init__(self) -> None:
        self.depth = False
        self.call: P2PCall | None = None
        self.since = 0.0


#: Every thread's Caller, by thread id (a thread's own entry is written by that thread only).
CALLERS: dict[int, Caller] = {}


def caller() -> Caller:
    """This thread's Caller (``CALLERS.get(threading.get_ident()) or caller()`` on the per-call path)."""
    ident = threading.get_ident()
    state = CALLERS.get(ident)
    if state is None:
        state = CALLERS[ident] = Caller()
    return state


class Calls:
    """A rank's watched calls: ``enter`` / ``done`` (or ``fail``) around every collective, ``p2p_post`` and the
    per-call path's book (``p2p``) for the point-to-point calls, and what failed first (``failed``)."""

    def __init__(self) -> None:
        self.skip = (*_SKIP, _torch_dir())
        """Where a frame is not the user's: the watch's folder and torch's (``call_site``)."""
        self.entered = 0
        # seq -> [about, since, Future or None, seq, bucket], about = (op, bytes, site): a call leaves when it
        # completes; one with a Future leaves when the Future is done, seen at the next step (a DDP bucket) or
        # heartbeat (no callback on the backend's thread, which cost a step 20 us)
        self._open: dict[int, list[Any]] = {}
        self._recent: deque[tuple[int, tuple[str, int | None, str]]] = deque(maxlen=RECENT)
        self.failed: dict[str, Any] | None = None
        self.on_failure: Callable[[], None] | None = None
        # point-to-point: the book the per-call path writes itself (``p2p.point_to_point``, no method call; the call
        # a thread blocks in is its ``Caller``'s), and its posts per direction and peer by direction
        self.p2p = P2PBook()
        self.p2p_posted: dict[str, dict[int | None, int]] = {"send": self.p2p.send, "recv": self.p2p.recv}
        self.p2p_batches = 0
        self.p2p_per_op: int | None = None
        """How many collectives the default group counts per point-to-point operation (gloo: 1, NCCL: 0), learned
        on the first call; until then the per-call path leaves the calls to ``p2p.issue``."""
        self.p2p_first_base: int | None = None
        """The default group's count before the first point-to-point call, while it runs (``p2p_per_op`` unknown)."""
        self._p2p_first: tuple[int, int] = (0, 0)  # the first call's operations and the group's count of them
        self._sites: dict[tuple[str, int], str] = {}  # call site by (file, line)
        self.not_user = (*self.skip, "<frozen")

    # -- collectives ------------------------------------------------------------------------------------------
    def enter(self, about: tuple[str, int | None, str], bucket: bool = False) -> list[Any]:
        """A collective begins on this rank (``about``: op, bytes, call site; ``bucket``: one of DDP's gradient
        buckets); its slot among the open calls (item 2 takes its Future, if it has one: the call completes when the
        Future is done)."""
        seq = self.entered + 1
        call = [about, time.monotonic(), None, seq, bucket]
        self.entered = seq  # before the insert: a reader counts only the open calls up to ``entered``
        self._open[seq] = call
        self._recent.append((seq, about))
        return call

    def done(self, call: list[Any]) -> None:
        """``call`` completed."""
        self._open.pop(call[3], None)

    def fail(self, call: list[Any], error: BaseException) -> None:
        """``call`` failed with ``error``: kept for the failure report, which runs at once."""
        if self._open.pop(call[3], None) is None:
            return
        if self.failed is None:
            about = call[0]
            self.failed = {"seq": call[3], "op": about[0], "site": about[2], "error": str(error).strip()}
        if self.on_failure is not None:
            self.on_failure()

    def sweep(self) -> None:
        """Complete the calls whose Future is done (with its error, if it failed)."""
        for call in list(self._open.values()):
            fut = call[2]
            if fut is not None and fut.done():
                error = future_error(fut)
                if error is None:
                    self.done(call)
                else:
                    self.fail(call, error)

    # -- point-to-point -------------------------------------------------------------------------------------------
    def user_frame(self, frame: Any) -> Any:
        """The first frame from ``frame`` outwards outside torch and the watch (None: no Python caller)."""
        skip = self.not_user
        while frame is not None and frame.f_code.co_filename.startswith(skip):
            frame = frame.f_back
        return frame

    def site_text(self, code: Any, lasti: int) -> str:
        """``file:line (function)`` of the instruction at ``lasti`` in ``code`` (a ``P2PCall``'s call site), made
        when a record or a report needs it, once per line."""
        if code is None:
            return "(no Python caller)"
        line = next((n for start, stop, n in code.co_lines() if start <= lasti < stop), None) or code.co_firstlineno
        key = (code.co_filename, line)
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = f"{os.path.basename(code.co_filename)}:{line} ({code.co_name})"
        return site

    def p2p_post(self, op: str, peers: Peers, frame: Any) -> P2PCall:
        """A point-to-point call is posted on the default group (``peers``: (``send`` or ``recv``, global rank or
        None for any source) per operation; ``frame``: its caller's, or any frame inside torch below it): what it
        is, numbered per peer and direction (a batch: by batches). The cold path (a batch, the first call);
        ``p2p.point_to_point`` does the same inline."""
        seq = 0
        for direction, peer in peers:
            posted = self.p2p_posted[direction]
            seq = posted[peer] = posted.get(peer, 0) + 1
        if len(peers) != 1:
            self.p2p_batches += 1
            seq = self.p2p_batches
        frame = self.user_frame(frame)
        return (op, peers, seq, None, 0) if frame is None else (op, peers, seq, frame.f_code, frame.f_lasti)

    def p2p_block(self, about: P2PCall) -> Caller:
        """This rank's current thread blocks in ``about`` (a blocking call, or a wait on an async one's request)
        until ``p2p_done`` with the Caller returned."""
        state = caller()
        state.since = time.monotonic()
        state.call = about
        return state

    def p2p_learn(self, ops: int, counted: int) -> None:
        """The default group counted ``counted`` collectives for the first point-to-point call (``ops`` operations)."""
        self._p2p_first = (ops, counted)
        self.p2p_per_op = counted // ops
        self.p2p_first_base = None

    def p2p_in_group(self) -> int:
        """How many of the default group's collectives are point-to-point operations: the first call's count, then
        ``p2p_per_op`` for each operation posted since (counted from the posts, not on the per-call path)."""
        per_op = self.p2p_per_op
        if not per_op:
            return self._p2p_first[1]
        ops = sum(list(self.p2p_posted["send"].values())) + sum(list(self.p2p_posted["recv"].values()))
        first_ops, first_counted = self._p2p_first
        return first_counted + per_op * (ops - first_ops)

    def p2p_done(self, state: Caller | None) -> None:
        """A point-to-point call returned (posted, or waited for: the Caller ``p2p_block`` gave)."""
        if state is not None:
            state.call = None
        self.p2p.returned += 1

    def p2p_fail(self, state: Caller | None, about: P2PCall, error: BaseException) -> None:
        """A point-to-point call failed (a peer gone): reported at once, as a failed collective is."""
        if state is not None:
            state.call = None
        if self.failed is None:
            self.failed = {"seq": about[2], "op": about[0], "site": self.p2p_site(about, threading.get_ident()),
                           "error": str(error).strip(), "peers": [list(p) for p in about[1]]}
        if self.on_failure is not None:
            self.on_failure()

    def p2p_site(self, about: P2PCall, thread: int) -> str:
        """``about``'s call site: its own (a batch, a first call), else the line where ``thread`` is now, in that
        call or in a wait on its request (its stack read only here, when a record or a report shows the call: taking
        the caller's frame in every call cost a pipeline's step more than the rest of the call's record)."""
        if about[3] is not None:
            return self.site_text(about[3], about[4])
        frame = self.user_frame(sys._current_frames().get(thread))
        return self.site_text(None, 0) if frame is None else self.site_text(frame.f_code, frame.f_lasti)

    def p2p_waiting(self, now: float) -> Waiting | None:
        """The point-to-point call blocked in longest by any thread of this rank."""
        longest: tuple[float, P2PCall, int] | None = None
        for thread, state in list(CALLERS.items()):
            about, since = state.call, state.since
            if about is not None and (longest is None or since < longest[0]):
                longest = (since, about, thread)
        if longest is None:
            return None
        since, about, thread = longest
        op, peers, seq = about[0], about[1], about[2]
        return {"seq": seq, "op": op, "bytes": None, "site": self.p2p_site(about, thread),
                "for": round(now - since, 3), "peers": [list(p) for p in peers]}


def future_error(fut: Any) -> BaseException | None:
    """The error a completed Future holds, or None (``value()`` raises it)."""
    try:
        fut.value()
    except Exception as exc:  # whatever the backend raised is what the report quotes
        return exc
    return None
