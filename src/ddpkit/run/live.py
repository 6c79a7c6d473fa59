"""Live healing for your own DDP script (``ddpkit run -n N --heal live``): a lost rank's replacement takes the state
of a live peer, and the others keep their processes. The change to a torchrun-style script is a few lines:

    from ddpkit.run import live

    replica = live.Replica(ddp_model, optimizer)             # after DDP(...): what a replacement takes from a peer
    for epoch in replica.epochs(first_epoch, max_epochs):     # a replacement starts at its peer's epoch,
        sampler.set_epoch(epoch)
        for x, y in replica.batches(loader):                  # skips the batches done in it,
            replica.step(train_step, x, y)                    # and a lost peer re-forms the group, the step settled

``step(fn, *args)`` runs one training step (zero_grad, forward, backward, optimizer.step). When its collective fails
because a peer is gone, the survivors re-form the group with the replacement (``ddpkit.comm.live``), wrap the same
DDP object over it again, and agree on the most advanced rank: the ranks behind it (the step in flight applied
elsewhere) and the replacement take its model, optimizer and position (the replacement its RNG state too); the
step is then done once, wherever it was not. Between ``init_process_group`` and ``Replica`` the script may run no
collective but DDP's constructor (the replacement runs the script's start-up while the survivors wait).

Under any other launcher (torchrun, srun, mpirun, ``ddpkit run`` without ``--heal live``) the three are what they
replace: ``range``, the loader itself, and a plain call. The script runs unchanged there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm.live import Exchanged, LiveGroup, peer_lost
from ddpkit.comm.rng import capture_rng, restore_rng
from ddpkit.process.worker_context import WorkerContext

__all__ = ["Replica"]

T = TypeVar("T")
#: The live-healed replicas of this process, held until it ends: after a heal, freeing a script's DDP model when its
#: function returns has hung in the group's destructor (``~Reducer`` -> ``~ProcessGroupGloo`` joining a thread that
#: never returns); a rank forked by ddpkit's agent ends with ``os._exit``, which runs no destructor.
_HELD: list[Replica] = []


class Replica:
    """This rank's model and optimizer, as live healing hands them from a live peer to a replacement."""

    def __init__(self, model: DDP, optimizer: Any) -> None:
        if not isinstance(model, DDP):
            raise TypeError(f"live.Replica takes the DistributedDataParallel model, not {type(model).__name__}: "
                            "wrap it first, model = DDP(model)")
        self.model, self.optimizer = model, optimizer
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
        """``range(start, stop)``; a replacement's starts at its peer's epoch."""
        first = self._first_epoch if self._first_epoch is not None else start
        for epoch in range(first, stop):
            self.epoch, self.batch = epoch, 0
            yield epoch

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
            except RuntimeError as exc:
                if self.group is None or not peer_lost(exc):
                    raise
                agreed = self._heal(exc)
                if agreed.step > self.done:  # the step in flight was applied elsewhere: taken with the state
                    self.done = agreed.step
                    return None
                continue  # applied nowhere: done now, in the new group
            self.done += 1
            if self.group is not None and self.group.joining:
                self.group.first_step()  # the agent's line
            return out

    # ---- healing ---------------------------------------------------------------------------------------------
    def _heal(self, exc: BaseException) -> Exchanged:
        assert self.group is not None
        module: nn.Module = self.model.module
        device = next(module.parameters()).device
        self.group.reform(exc, device, self.model)
        # the same DDP object over the new group, so the script's references to it hold (its constructor's
        # collectives meet the replacement's own DDP(...))
        DDP.__init__(self.model, module, device_ids=self.model.device_ids)
        agreed = self.group.exchange(self.done, self._give)
        self._take(agreed, joining=False)
        return agreed

    def _give(self, step: int) -> dict[str, Any]:
        return {"step": step, "epoch": self.epoch, "batch": self.batch, "model": self.model.module.state_dict(),
                "optimizer": self.optimizer.state_dict(), "rng": capture_rng()}

    def _take(self, agreed: Exchanged, *, joining: bool) -> None:
        given = agreed.state
        if given is None:
            return
        self.model.module.load_state_dict(given["model"])
        self.optimizer.load_state_dict(given["optimizer"])
        if joining:
            restore_rng(given["rng"])
            self.done = agreed.step
            self._first_epoch, self._skip = given["epoch"], given["batch"]
