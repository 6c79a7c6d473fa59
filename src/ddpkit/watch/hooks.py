"""Where the watch sees a rank's collectives, without a change to the user's script.

- ``torch.distributed``'s collectives (``all_reduce``, ``barrier``, ``all_gather_object``, ...) are wrapped in the
  module (and in ``distributed_c10d``, where torch's own helpers look them up). Only calls on the default group are
  counted, and a collective called from inside another (``all_gather_object`` runs two ``all_gather``) counts once,
  so every rank numbers the same calls the same way.
- DDP's gradient all-reduces come from its C++ Reducer, which no Python wrapper sees; a communication hook does
  (pytorch/pytorch#71303 suggests exactly this for straggler detection). ``register_comm_hook`` is wrapped so the
  user's hook (or ddpkit train's) is itself wrapped. A DDP model with no hook stays on DDP's C++ path (adding
  torch's Python ``allreduce_hook`` would cost it more than the watch itself: ``_watch_hookless``): its all-reduces
  are counted by the process group's sequence number, and its gradient-sync time comes from DDP's own runtime
  statistics. ddpkit's own hook (``comm/gradients.GradientAveraging``, ``train`` and ``check``) is counted the same
  way, unwrapped: it names its counter, issues its collectives through the originals (``_ddpkit_original`` on each
  wrapper), and counts the calls that bypass the group (MPI) itself. The forward wrapper marks a step either way.
- Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) on the default group are
  wrapped too (``watch/p2p.py``), numbered apart, with their peers, and ``Work.wait`` with them.
- ``init_process_group`` starts the watch once the group exists; ``destroy_process_group`` ends it (summary).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import time
from collections.abc import Callable
from typing import Any

from ddpkit.watch import p2p
from ddpkit.watch.calls import CALLERS, Caller, call_site, caller, parameters, position, wrapper_of
from ddpkit.watch.frames import hide_wrappers
from ddpkit.watch.p2p import POINT_TO_POINT
from ddpkit.watch.recorder import Live, Recorder

__all__ = ["COLLECTIVES", "POINT_TO_POINT", "Hooks", "inside"]

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce",
               "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "monitored_barrier", "reduce", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "scatter_object_list")


def inside() -> Caller:
    """This thread's place in the watched calls: ``inside().depth = True`` makes its calls pass through unwatched,
    as calls nested in a watched one do."""
    return caller()


def _nbytes(value: Any) -> int | None:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return sum(v.numel() * v.element_size() for v in value)
    return None


class Hooks:
    """The patches for one watch. ``live.recorder`` is the current watch's Recorder: a hook wrapped under an earlier
    watch reports to a later one."""

    def __init__(self, live: Live, on_init: Callable[[dict[str, Any]], None],
                 on_destroy: Callable[[], None]) -> None:
        self.live = live
        self.on_init = on_init
        self.on_destroy = on_destroy
        self._saved: list[tuple[object, str, Any]] = []
        self._p2p_wrapper: dict[Callable[..., Any], Callable[..., Any]] = {}  # torch's isend -> the watch's

    def _set(self, owner: object, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch.nn.parallel import DistributedDataParallel as DDP

        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._collective(name, original)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._set(module, name, wrapped)
        for name in POINT_TO_POINT:
            original = getattr(c10d, name)
            wrapped = p2p.point_to_point(self.live, name, original)
            self._p2p_wrapper[original] = wrapped
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._set(module, name, wrapped)
        batch = c10d.batch_isend_irecv
        for module in (dist, c10d):
            if getattr(module, "batch_isend_irecv", None) is batch:
                self._set(module, "batch_isend_irecv", p2p.batch(self.live, self._p2p_wrapper, batch))
        check = getattr(c10d, "_check_op", None)
        if check is not None:  # a P2POp built from torch's isend taken before the watch began: still valid
            wrapper = self._p2p_wrapper
            self._set(c10d, "_check_op", functools.wraps(check)(lambda op: check(wrapper.get(op, op))))
        self._set(c10d.Work, "wait", p2p.wait(self.live, c10d.Work.wait))
        init, destroy = c10d.init_process_group, c10d.destroy_process_group
        for module in (dist, c10d):
            self._set(module, "init_process_group", self._init(init))
            self._set(module, "destroy_process_group", self._destroy(destroy))
        self._set(DDP, "register_comm_hook", self._register(DDP.register_comm_hook))
        self._set(DDP, "_register_builtin_comm_hook", self._builtin(DDP._register_builtin_comm_hook))
        self._set(DDP, "forward", self._forward(DDP.forward))
        import torch
        from torch.utils.data.distributed import DistributedSampler

        # where a resumed script went on from (goodput.positions): the epoch it began, and whether it loaded state
        self._set(DistributedSampler, "set_epoch", self._noting(DistributedSampler.set_epoch, _epoch_began))
        for owner, name in ((torch, "load"), (torch.nn.Module, "load_state_dict"),
                            (torch.optim.Optimizer, "load_state_dict")):
            self._set(owner, name, self._noting(getattr(owner, name), lambda rec, _args, _kwargs: rec.state_loaded()))

    def uninstall(self) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    # -- process group ----------------------------------------------------------------------------------------
    def _init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        params = parameters(original)

        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                out = original(*args, **kwargs)
                self.on_init({**dict(zip(params, args, strict=False)), **kwargs})
                return out
            except BaseException as exc:
                hide_wrappers(exc)  # the user's frames and torch's only
                raise

        return init_process_group

    def _destroy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def destroy_process_group(group: Any = None) -> Any:
            import torch.distributed as dist

            if group is None or group is dist.GroupMember.WORLD:
                self.on_destroy()
            return original(group)

        return destroy_process_group

    # -- torch.distributed collectives ------------------------------------------------------------------------
    def _collective(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        group_at, async_at = position(original, "group"), position(original, "async_op")
        live, callers, thread_id = self.live, CALLERS, threading.get_ident

        def collective(*args: Any, **kwargs: Any) -> Any:
            try:
                rec = live.recorder
                if rec is None:
                    return original(*args, **kwargs)
                state = callers.get(thread_id()) or caller()
                if state.depth:
                    return original(*args, **kwargs)
                group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
                if group is not None:
                    import torch.distributed as dist

                    if group is not dist.GroupMember.WORLD:
                        return original(*args, **kwargs)
                is_async = kwargs.get("async_op", args[async_at] if async_at is not None and len(args) > async_at
                                      else False)
                call = rec.enter((name, _nbytes(args[0] if args else next(iter(kwargs.values()), None)),
                                  call_site(rec.skip)))
                state.depth = True
                try:
                    out = original(*args, **kwargs)
                except BaseException as exc:
                    rec.fail(call, exc)
                    raise
                finally:
                    state.depth = False
                if is_async and out is not None:
                    try:
                        call[2] = out.get_future()  # completed when it is done, seen at the next step or heartbeat
                    except RuntimeError:  # a Work without a future: counted done once issued
                        rec.done(call)
                else:
                    rec.done(call)
                return out
            except BaseException as exc:
                hide_wrappers(exc)  # the user's frames and torch's only
                raise

        return wrapper_of(original, collective)  # holding torch's own: for a hook that counts itself

    # -- DDP --------------------------------------------------------------------------------------------------
    def _wrap_hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        # per bucket: its op name, size and call site, found once (the site is the line that calls backward, the
        # same every step; walking the stack per bucket cost more than a small MPI all-reduce)
        known: dict[int, tuple[str, int, str]] = {}
        live = self.live

        @functools.wraps(hook)
        def watched_hook(state: Any, bucket: Any) -> Any:
            rec = live.recorder
            if rec is None:
                return hook(state, bucket)
            index = bucket.index()
            about = known.get(index)
            if about is None:
                buffer = bucket.buffer()
                about = known[index] = (f"DDP gradient all-reduce (bucket {index})",
                                        buffer.numel() * buffer.element_size(), call_site(rec.skip))
            call = rec.enter(about, True)
            inside = caller()
            inside.depth = True
            try:
                fut = hook(state, bucket)
            except BaseException as exc:
                rec.fail(call, exc)
                raise
            finally:
                inside.depth = False
            # completed when the Future is done (at once for a transport that completes in the hook, MPI), seen at
            # the next step or heartbeat, or when an exception leaves the user's code (``note_exception``)
            call[2] = fut
            if not rec.sampling or fut.done():
                return fut
            since = time.monotonic()  # one step in SAMPLE_EVERY: the bucket's time in flight, for the straggler

            def timed(f: Any) -> Any:
                rec.bucket_done(since)
                return f.value()

            return fut.then(timed)

        return watched_hook

    def _register(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def register_comm_hook(model: Any, state: object, hook: Callable[..., Any]) -> Any:
            counter = getattr(hook, "_ddpkit_counter", None)
            if counter is not None:  # ddpkit's own hook counts its calls: counted at the first forward, unwrapped
                model._ddpkit_counter = counter
                return original(model, state, hook)
            model._ddpkit_watched = True
            return original(model, state, self._wrap_hook(hook))

        return register_comm_hook

    def _builtin(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _register_builtin_comm_hook(model: Any, comm_hook_type: Any) -> Any:
            model._ddpkit_watched = True  # a C++ hook: its all-reduces are counted, not seen one by one
            result = original(model, comm_hook_type)
            rec = self.live.recorder
            if rec is not None:
                rec.count_group(model)
                model._ddpkit_seen = rec
            return result

        return _register_builtin_comm_hook

    def _forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        grad_enabled = torch.is_grad_enabled
        live = self.live

        @functools.wraps(original)
        def forward(model: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                rec = live.recorder
                if rec is not None:
                    state = model.__dict__
                    if state.get("_ddpkit_seen") is not rec:  # its first forward under this watch
                        if not state.get("_ddpkit_watched"):
                            _watch_hookless(model, rec)
                        model._ddpkit_seen = rec
                    if model.training and grad_enabled():
                        rec.step()
                return original(model, *args, **kwargs)
            except BaseException as exc:
                hide_wrappers(exc)  # the user's frames and torch's only
                raise

        return forward

    def _noting(self, original: Callable[..., Any],
                note: Callable[[Recorder, tuple[Any, ...], dict[str, Any]], None]) -> Callable[..., Any]:
        """``original``, told to the recorder first (``note(recorder, args, kwargs)``): a call made once an epoch or
        a run, off the per-step path."""
        live = self.live

        @functools.wraps(original)
        def noting(*args: Any, **kwargs: Any) -> Any:
            try:
                rec = live.recorder
                if rec is not None:
                    note(rec, args, kwargs)
                return original(*args, **kwargs)
            except BaseException as exc:
                hide_wrappers(exc)  # the user's frames and torch's only
                raise

        return noting


def _watch_hookless(model: Any, rec: Recorder) -> None:
    """A DDP model without a communication hook stays on DDP's C++ path and is counted (``Recorder.count_group``).
    Giving it torch's Python ``allreduce_hook`` instead, so that each bucket is seen, costs more than the watch may:
    70 us per step for the hook alone on a 1.4k-parameter model (one process, benchmarks/watch_cost.py), and for a
    large model a division pass of its own (1.5 ms per step on ``train --model mlp``'s 19 MB, 3%); counting costs
    about 10 us per step. A model on ddpkit's own hook is counted the same way, with the hook's own count."""
    rec.count_group(model, model.__dict__.get("_ddpkit_counter"))


def _epoch_began(rec: Recorder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``DistributedSampler.set_epoch(sampler, epoch)`` was called: the recorder places the epoch."""
    epoch: Any = kwargs.get("epoch", args[1] if len(args) > 1 else None)
    with contextlib.suppress(TypeError):  # an epoch that is no integer (or none) places nothing
        rec.epoch_began(operator.index(epoch))
