"""Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) on the default group, seen
as the watch sees collectives: numbered apart (per peer and direction, ``Calls.p2p_post``), with their peers. A
blocking call is open while it runs; an async one's request (a ``Work``: gloo's has no Future) is remembered, and
``Work.wait`` (patched on the class) opens the call again while the rank waits on it. ``send`` and ``recv`` are
``isend`` / ``irecv`` and a ``wait`` inside torch: the inner calls pass through, as a collective nested in another
does (``Caller.depth``).

A pipeline makes a few of these calls in every step, each a few microseconds of Python at most, so the per-call path
is written for its cost (benchmarks/results/bench_watch.md: it was 4% of a 2.6 ms step): one function per call with
torch's own parameters (packing and unpacking ``*args, **kwargs`` cost a call about as much as its record), its
source written for its kind (blocking or async) with its names as constants, no method call, one tuple for its
record, the thread's state in plain slots (``Caller``: a ``threading.local`` cost more than the record), the
counts in the slots of one small book (``P2PBook``: a call comes cold after the step's compute, and the recorder's
many attributes cost it more cache misses), and no frame taken: the call site is read from the blocked thread's
stack when a record shows the call (``Calls.p2p_site``; ``sys._getframe`` in every call cost a step about a
quarter of the watch's cost), so an async call is named at the line that waits on it. The first call on the group
(which learns how the group counts them), a batch and a torch whose signatures differ take the general path
(``general``, ``issue``).
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpkit.watch.calls import CALLERS, Caller, P2PCall, caller, position, wrapper_of
from ddpkit.watch.frames import hide_wrappers
from ddpkit.watch.recorder import Live, Recorder

__all__ = ["POINT_TO_POINT", "batch", "failed", "general", "issue", "point_to_point", "wait", "world"]

#: Point-to-point calls, by the argument that names the peer (a global rank; ``group_*``: the group's, the same on
#: the default group).
POINT_TO_POINT = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}

_HERE = os.path.dirname(__file__)  # as calls.py names the watch's folder
#: The per-call wrapper, for torch's own signature ``(tensor, dst | src, group, tag, group_dst | group_src)``: a
#: blocking call (``send``, ``recv``) is open while it runs; an async one's request is remembered for its wait. The
#: book is ``live.p2p`` (None: no watch, or its first call not made: the general path).
_PER_CALL = '''\
def {name}(tensor, {peer}=None, group=None, tag=0, group_{peer}=None):
    try:
        p = live.p2p
        if p is None:
            return general(tensor, {peer}, group, tag, group_{peer})
        state = callers.get(thread_id()) or caller()
        if state.depth or group is not None and group is not p.world:  # nested in a watched call, or a sub-group's
            return original(tensor, {peer}, group, tag, group_{peer})
        peer = {peer} if {peer} is not None else group_{peer}
        posted = p.{direction}
        seq = posted[peer] = posted.get(peer, 0) + 1
        about = ("{name}", (("{direction}", peer),), seq, None, 0)
{opened}        state.depth = True
        try:
            out = original(tensor, {peer}, group, tag, group_{peer})
        except BaseException as exc:
            failed(live, {blocked}, about, exc)
            raise
        finally:
            state.depth = False
{closed}        p.returned += 1
        return out
    except BaseException as exc:
        hide(exc)  # the user's frames and torch's only
        raise
'''
#: What differs by kind: a blocking call (True) is open while it runs; an async one's request is remembered.
_KIND = {True: {"opened": "        state.since = monotonic()\n        state.call = about\n", "blocked": "state",
                "closed": "        state.call = None\n"},
         False: {"opened": "", "blocked": "None",
                 "closed": "        if out is not None:\n            p.requests[out] = about\n"}}


def point_to_point(live: Live, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The watch's ``name`` (``send``, ``isend``, ``recv`` or ``irecv``) around torch's ``original``."""
    peer_arg = POINT_TO_POINT[name]
    slow = general(live, name, original)
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return slow
    expected = {"tensor": inspect.Parameter.empty, peer_arg: None, "group": None, "tag": 0, f"group_{peer_arg}": None}
    if {p.name: p.default for p in params.values()} != expected or list(params) != list(expected) or \
            any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values()):
        return slow
    namespace: dict[str, Any] = {
        "live": live, "original": original, "general": slow, "callers": CALLERS, "caller": caller,
        "thread_id": threading.get_ident, "monotonic": time.monotonic, "failed": failed, "hide": hide_wrappers}
    # its file is named in the watch's folder, whose frames a call site skips; its lines show in a traceback
    source = _PER_CALL.format(name=name, peer=peer_arg, direction="send" if peer_arg == "dst" else "recv",
                              **_KIND[name in ("send", "recv")])
    filename = os.path.join(_HERE, f"p2p.py ({name}, generated)")
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)  # a fixed template with torch's names
    return wrapper_of(original, namespace[name])


def general(live: Live, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``point_to_point``'s general path, for any signature of ``original``."""
    group_at, peer_at = position(original, "group"), position(original, POINT_TO_POINT[name])
    peer_arg = POINT_TO_POINT[name]
    direction, group_peer = "send" if peer_arg == "dst" else "recv", f"group_{peer_arg}"
    blocking = name in ("send", "recv")

    def point_to_point(*args: Any, **kwargs: Any) -> Any:
        try:
            rec = live.recorder
            if rec is None or caller().depth:
                return original(*args, **kwargs)
            group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
            if group is not None and group is not (rec.p2p.world or world(rec)):
                return original(*args, **kwargs)  # a sub-group's calls pass unwatched, as its collectives do
            peer = kwargs.get(peer_arg, args[peer_at] if peer_at is not None and len(args) > peer_at else None)
            if peer is None:
                peer = kwargs.get(group_peer)
            about = rec.p2p_post(name, ((direction, peer),), sys._getframe(1))
            return issue(live, rec, about, 1, blocking, original, args, kwargs)
        except BaseException as exc:
            hide_wrappers(exc)  # the user's frames and torch's only
            raise

    return wrapper_of(original, point_to_point)


def batch(live: Live, wrappers: dict[Callable[..., Any], Callable[..., Any]],
          original: Callable[..., Any]) -> Callable[..., Any]:
    """The watch's ``batch_isend_irecv`` (``wrappers``: torch's ``isend`` and ``irecv`` -> the watch's)."""

    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        try:
            for op in p2p_op_list if isinstance(p2p_op_list, list) else ():
                known: Any = getattr(op, "op", None)
                if known in wrappers:  # torch tells a send from a receive by identity with its isend: the watch's now
                    op.op = wrappers[known]
            rec = live.recorder
            if rec is None or caller().depth or not isinstance(p2p_op_list, list) or not p2p_op_list:
                return original(p2p_op_list)
            group = getattr(p2p_op_list[0], "group", None)
            if group is not None and group is not (rec.p2p.world or world(rec)):
                return original(p2p_op_list)
            peers = tuple(("send" if "send" in getattr(op.op, "__name__", "") else "recv", op.peer)
                          for op in p2p_op_list)
            about = rec.p2p_post("batch_isend_irecv", peers, sys._getframe(1))
            return issue(live, rec, about, len(peers), False, original, (p2p_op_list,), {})
        except BaseException as exc:
            hide_wrappers(exc)  # the user's frames and torch's only
            raise

    return wrapper_of(original, batch_isend_irecv)


_NO_TIMEOUT = object()


def wait(live: Live, original: Callable[..., Any]) -> Callable[..., Any]:
    """The watch's ``Work.wait``: a wait on an async point-to-point call's request is a wait in that call."""
    callers, monotonic, thread_id = CALLERS, time.monotonic, threading.get_ident

    @functools.wraps(original)
    def wait(work: Any, timeout: Any = _NO_TIMEOUT) -> Any:
        try:
            p = live.p2p
            if p is None:  # before the first call learned (its request is in the recorder's book), or no watch
                rec = live.recorder
                if rec is None:
                    return original(work) if timeout is _NO_TIMEOUT else original(work, timeout)
                p = rec.p2p
            if not p.requests:
                return original(work) if timeout is _NO_TIMEOUT else original(work, timeout)
            state = callers.get(thread_id()) or caller()
            about = None if state.depth else p.requests.pop(work, None)
            if about is None:  # a collective's request, one waited for already, or a wait inside a watched call
                return original(work) if timeout is _NO_TIMEOUT else original(work, timeout)
            state.since = monotonic()
            state.call = about
            state.depth = True
            try:
                out = original(work) if timeout is _NO_TIMEOUT else original(work, timeout)
            except BaseException as exc:
                failed(live, state, about, exc)
                raise
            finally:
                state.depth = False
            state.call = None
            p.returned += 1
            return out
        except BaseException as exc:
            hide_wrappers(exc)  # the user's frames and torch's only
            raise

    return wait


def world(rec: Recorder) -> Any:
    """The default group (``GroupMember.WORLD`` is a property that looks it up: kept in the recorder's book, which
    lives as long as the group)."""
    import torch.distributed as dist

    rec.p2p.world = dist.GroupMember.WORLD
    return rec.p2p.world


def failed(live: Live, state: Caller | None, about: P2PCall, error: BaseException) -> None:
    """The per-call path's call ``about`` failed (``state``: the thread's Caller, when it blocked in the call)."""
    if state is not None:
        state.call = None
    rec = live.recorder
    if rec is not None:
        rec.p2p_fail(None, about, error)


def issue(live: Live, rec: Recorder, about: P2PCall, ops: int, blocking: bool, original: Callable[..., Any],
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Post a point-to-point call of ``ops`` operations through ``original``, open while it runs when
    ``blocking`` (the general path); an async call's requests (one, or a batch's list) are remembered for their
    waits. The default group counts each operation as a collective on gloo (none on
    NCCL): how many is measured on the first call, and from then on the posts are taken out of the group's count
    (``Calls.p2p_in_group``; a call counts as soon as it is posted). Once that is known, the per-call path
    takes the next call (``live.p2p``)."""
    learn = rec.p2p_per_op is None
    if learn:
        counted = rec.p2p_first_base = (rec.p2p.world or world(rec))._get_sequence_number_for_group()
    state = caller()
    if blocking:
        rec.p2p_block(about)
    state.depth = True
    try:
        out = original(*args, **kwargs)
    except BaseException as exc:
        rec.p2p_fail(state if blocking else None, about, exc)
        raise
    finally:
        state.depth = False
        if learn:
            rec.p2p_learn(ops, rec.p2p.world._get_sequence_number_for_group() - counted)
    rec.p2p_done(state if blocking else None)
    if live.p2p is None and live.recorder is rec:
        live.p2p = rec.p2p  # learned: the per-call path takes the next call
    if not blocking and out is not None:
        for work in out if isinstance(out, list) else (out,):
            rec.p2p.requests[work] = about
    return out
