"""Live healing for your own DDP script (``ddpkit run -n N --heal live``): a lost rank's replacement takes the state
of a live peer, and the others keep their processes. The change to a torchrun-style script is a few lines:

    from ddpkit.run import live

    replica = live.Replica(ddp_model, optimizer, scheduler)  # after DDP(...): everything the loop carries
    for epoch in replica.epochs(first_epoch, max_epochs):     # a replacement starts at its peer's epoch,
        sampler.set_epoch(epoch)
        for x, y in replica.batches(loader):                  # skips the batches done in it,
            replica.step(train_step, x, y)                    # and a lost peer re-forms the group, the step settled

``Replica(model, optimizer, *stateful)``: after the model and the optimizer, every object the training loop carries
whose state changes as it trains, each with ``state_dict``/``load_state_dict`` (an LR scheduler, a ``GradScaler``,
an EMA model, a sampler or loader with state, a counter of the script's own): a replacement takes them all from its
peer. What is left out diverges, and is found: one step after every heal and at the end of the run the ranks
compare a digest of their weights and optimizer state (its learning rate included); a difference ends the attempt
with one line naming the ranks that differ (``ReplicasDiverged``), and the restart heal follows.

``step(fn, *args)`` runs one training step (zero_grad, forward, backward, optimizer.step). When it raises a
collective's error, the agent says whether a peer was lost (it sees every rank's process): if so, the survivors
re-form the group with the replacements (``live.rank.group``), wrap the same DDP object over it again, and agree on
the most advanced rank: the ranks behind it (the step in flight applied elsewhere) and the replacements take its
state and position (the replacements its RNG state too); the step is then done once, wherever it was not. Any other
exception is the script's own and is raised at once. Between ``init_process_group`` and ``Replica`` the script may
run no collective but DDP's constructor (the replacement runs the script's start-up while the survivors wait).

Under any other launcher (torchrun, srun, mpirun, ``ddpkit run`` without ``--heal live``) the three are what they
replace: ``range``, the loader itself, and a plain call. The script runs unchanged there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm.rng import capture_rng, restore_rng
from ddpkit.live.rank.group import Exchanged, LiveGroup, ReplicasDiverged, equal_line
from ddpkit.process.worker_context import WorkerContext

__all__ = ["Replica", "ReplicasDiverged", "Stateful"]

T = TypeVar("T")
#: The live-healed replicas of this process, held until it ends: after a heal, freeing a script's DDP model when its
#: function returns has hung in the group's destructor (``~Reducer`` -> ``~ProcessGroupGloo`` joining a thread that
#: never returns); a rank forked by ddpkit's agent ends with ``os._exit``, which runs no destructor.
_HELD: list[Replica] = []


class Stateful(Protocol):
    """What ``Replica`` carries beside the model and the optimizer (torch's ``Stateful``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class Replica:
    """This rank's model, optimizer and every other object with state, as live healing hands them from a live peer
    to a replacement."""

    def __init__(self, model: DDP, optimizer: Any, *stateful: Stateful) -> None:
        if not isinstance(model, DDP):
            raise TypeError(f"live.Replica takes the DistributedDataParallel model, not {type(model).__name__}: "
                            "wrap it first, model = DDP(model)")
        for index, thing in enumerate((optimizer, *stateful)):
            if not (callable(getattr(thing, "state_dict", None)) and callable(getattr(thing, "load_state_dict", None))):
                raise TypeError(f"live.Replica's argument {index + 2} ({type(thing).__name__}) has no "
                                "state_dict/load_state_dict: pass the optimizer, then objects with state (an LR "
                                "scheduler, a GradScaler, an EMA model...)")
        self.model, self.optimizer, self.stateful = model, optimizer, tuple(stateful)
        self.epoch, self.batch, self.done = 0, 0, 0
        """The epoch and batch under way, and the steps this rank applied."""
        self._first_epoch: int | None = None
        self._skip = 0
        context = WorkerContext.from_environ()
        self.group: LiveGroup | None = None
        if context.live_gen is not None:
            from torch.distributed.constants import default_pg_timeout

            self.group = LiveGroup(context, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                   backend=str(dist.get_backend()), timeout=default_pg_timeout,
                                   pg_prefix="default_pg")  # init_process_group's own prefix for env://
            _HELD.append(self)
            if self.group.joining:  # a replacement: the most advanced peer's state and place, now
                self._take(self.group.exchange(-1, self._give), joining=True)

    def epochs(self, start: int, stop: int) -> Iterator[int]:
        """``range(start, stop)``; a replacement's starts at its peer's epoch. At the end under ``--heal live`` the
        replicas are compared, and rank 0 says so."""
        first = self._first_epoch if self._first_epoch is not None else start
        for epoch in range(first, stop):
            self.epoch, self.batch = epoch, 0
            yield epoch
        if self.group is not None:
            digests = self.group.verify(self.model.module, self.optimizer, step=self.done, where="at the end")
            if self.group.rank == 0:
                print(f"Live heals: {self.group.heals}; replicas: {equal_line(digests)}", flush=True)

    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """The loader's batches; in a replacement's first epoch, from its peer's batch on."""
        skip, self._skip = self._skip, 0
        for index, item in enumerate(loader):
            if index < skip:
                continue
            self.batch = index
            yield item

    def step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``, one training step; a lost peer heals the group and the step is done once (None
        where it was applied elsewhere and taken from there)."""
        while True:
            try:
                out = fn(*args, **kwargs)
            except Exception as exc:
                plan = None if self.group is None else self.group.lost_peer(exc)
                if plan is None:
                    raise
                agreed = self._heal(plan, exc)
                if agreed.step > self.done:  # the step in flight was applied elsewhere: taken with the state
                    self.done = agreed.step
                    return None
                continue  # applied nowhere: done now, in the new group
            self.done += 1
            self._applied()
            return out

    def _applied(self) -> None:
        if self.group is not None:  # one step after a heal, the replicas compared; a replacement's first step said
            self.group.applied(self.done, self.model.module, self.optimizer)

    # ---- healing ---------------------------------------------------------------------------------------------
    def _heal(self, plan: Any, exc: BaseException) -> Exchanged:
        assert self.group is not None
        module: nn.Module = self.model.module
        device = next(module.parameters()).device
        settings, hooks = ddp_settings(self.model), list(getattr(self.model, "_comm_hooks", []))
        keep = self.group.reform(plan, exc, device, self.model, done=self.done)
        # the same DDP object over the new group, so the script's references to it hold (its constructor's
        # collectives meet the replacement's own DDP(...)), as the script built it: its settings, its comm hooks.
        # Its constructor broadcasts rank 0's weights: where rank 0 is behind or a replacement, the most advanced
        # ranks keep theirs (a copy in host memory, put back), so the exchange hands on the most advanced state
        kept = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()} if keep else None
        DDP.__init__(self.model, module, **settings)
        if kept is not None:
            module.load_state_dict(kept)
        for hook, state in hooks:
            self.model.register_comm_hook(_regrouped(state), hook)
        agreed = self.group.exchange(self.done, self._give)
        self._take(agreed, joining=False)
        return agreed

    def _give(self, step: int) -> dict[str, Any]:
        return {"step": step, "epoch": self.epoch, "batch": self.batch, "model": self.model.module.state_dict(),
                "optimizer": self.optimizer.state_dict(), "stateful": [s.state_dict() for s in self.stateful],
                "rng": capture_rng()}

    def _take(self, agreed: Exchanged, *, joining: bool) -> None:
        given = agreed.state
        if given is None:
            return
        self.model.module.load_state_dict(given["model"])
        self.optimizer.load_state_dict(given["optimizer"])
        for thing, state in zip(self.stateful, given["stateful"], strict=True):
            thing.load_state_dict(state)
        if joining:
            restore_rng(given["rng"])
            self.done = agreed.step
            self._first_epoch, self._skip = given["epoch"], given["batch"]


#: ``DDP.__init__``'s arguments the object keeps under the same name (torch's own), passed again as they are
_KEPT = ("device_ids", "output_device", "dim", "find_unused_parameters", "gradient_as_bucket_view", "static_graph",
         "mixed_precision", "skip_all_reduce_unused_params", "batched_grad_copy", "forward_sync_buffers")


def ddp_settings(ddp: DDP) -> dict[str, Any]:
    """What ``DDP(module, ...)`` was given, as the object keeps it, for the same DDP over a re-formed group (the
    replacement's script builds its own with the same arguments): each of ``_KEPT`` this torch's ``DDP.__init__``
    takes and the object holds, and the bucket size where one was given."""
    takes = inspect.signature(DDP.__init__).parameters
    settings = {name: getattr(ddp, name) for name in _KEPT if name in takes and hasattr(ddp, name)}
    if not getattr(ddp, "bucket_bytes_cap_default", True):
        settings["bucket_cap_mb"] = ddp.bucket_bytes_cap / (1024 * 1024)
    return settings


def _regrouped(state: Any) -> Any:
    """A comm hook's state for the re-formed group: a process group (the old one is gone) becomes None, which torch's
    hooks read as the default group; a state that holds one (PowerSGD's) gets None there too."""
    if isinstance(state, dist.ProcessGroup):
        return None
    if isinstance(getattr(state, "process_group", None), dist.ProcessGroup):
        state.process_group = None
    return state
