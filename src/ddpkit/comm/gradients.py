"""How the trainer averages gradients across the ranks: a DDP communication hook and the transport it sums with.

Small models (up to PYTHON_HOOK_MAX_PARAMS parameters) average through the Python hook here, which also carries
values that must reach every rank in the same step (the preemption stop flags, see ``train/faults.py``) appended to
the last gradient bucket: one extra number, no extra collective. Larger models keep DDP's C++ all-reduce (a Python
hook and a copy per bucket would cost more than what it saves), and the flags travel in a separate vote.

Transports, by name (``TRANSPORTS``; ``choose_transport`` picks one for the process group's backend):

- ``all-reduce``: ``dist.all_reduce`` of each bucket; any backend.
- ``gloo-gather``: on gloo, a bucket whose gathered size is at most GATHER_MAX_BYTES is all-gathered and summed
  locally in rank order instead of all-reduced. Small CPU messages are latency-bound, and gloo's all-gather takes
  half the message steps of its all-reduce (ring: n-1 instead of 2(n-1)); measured on 2 ranks here
  (benchmarks/results/bench_train.md): 23 floats 0.5-0.8 ms instead of 1.4-2.1 ms, 64 Ki floats 1.4-2.4x faster,
  256 Ki about even (1.0-1.3x), hence the 512 KiB bound. Every rank sums the same gathered rows in the same order,
  so the ranks stay bitwise identical (the same as the all-reduce on 2 ranks, where a + b == b + a).
- ``mpi``: ``MPI.Allreduce`` in place on the bucket's flat CPU buffer (``comm/mpi_transport.py``, mpi4py imported
  lazily), for ranks started by an MPI launcher. MPI's latency is microseconds, so the hook pays for itself at any
  model size: with ``mpi`` every model averages through the hook, and the rider always rides.

``plan_transport`` turns the user's ``--grad-transport auto|gloo|mpi|nccl`` into one of these before the process group
starts (it refuses, exit 2, what cannot work here).

Under the watch (``ddpkit.watch``) the hook is not wrapped: it counts its own buckets (``GradientAveraging.issued``,
one integer add) and its collectives are issued through the unwatched functions (``_unwatched``), so the watch
counts them by the process group's sequence number, as it does DDP's C++ path, plus ``issued`` for a transport that
bypasses the group (``mpi``). A Python wrapper per bucket costs a sub-millisecond step 1.5-5%
(benchmarks/results/bench_watch.md); a count costs nothing measurable.

Another transport (MPI, NCCL with compression) is a function ``make(world_size) -> Sum`` added to TRANSPORTS under
its name, and a line in ``choose_transport``; the hook, the rider and the trainer stay as they are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddpkit.base.errors import ConfigError
from ddpkit.base.log import get_logger
from ddpkit.comm import GRAD_TRANSPORTS
from ddpkit.comm.torch_compat import all_gather_single

__all__ = ["GRAD_TRANSPORTS", "PYTHON_HOOK_MAX_PARAMS", "TRANSPORTS", "GradientAveraging", "Rider", "choose_transport",
           "plan_transport", "register_gradient_averaging"]

log = get_logger(__name__)

#: Models up to this many parameters average through the Python hook (their single, small bucket carries the rider).
PYTHON_HOOK_MAX_PARAMS = 1 << 18
#: gloo-gather: a bucket whose gathered size (bytes x ranks) is at most this is all-gathered and summed locally.
GATHER_MAX_BYTES = 512 << 10

Future = torch.futures.Future
#: The sum of a tensor over the ranks, asynchronously: ``sum(tensor, then)`` returns a Future of ``then(total)``,
#: ``then`` called on the thread that completes the collective (one callback, no second Future in between).
Sum = Callable[[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], "Future[torch.Tensor]"]


def _unwatched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as torch defines it: the watch's wrapper of a collective names its original (``_ddpkit_original``); the
    watch counts this hook's calls itself (``count_group``) and must not see each one again, at a stack walk each."""
    return getattr(fn, "_ddpkit_original", fn)


def all_reduce_sum(world_size: int) -> Sum:
    """``dist.all_reduce`` of the whole tensor, in place."""
    all_reduce = _unwatched(dist.all_reduce)

    def total(tensor: torch.Tensor, then: Callable[[torch.Tensor], torch.Tensor]) -> Future[torch.Tensor]:
        work = all_reduce(tensor, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: then(fut.value()[0]))

    return total


def gloo_gather_sum(world_size: int) -> Sum:
    """All-gather and sum locally in rank order where the gathered tensor is at most GATHER_MAX_BYTES; else
    all-reduce."""
    all_gather = _unwatched(all_gather_single())
    reduce = all_reduce_sum(world_size)

    def total(tensor: torch.Tensor, then: Callable[[torch.Tensor], torch.Tensor]) -> Future[torch.Tensor]:
        if tensor.numel() * tensor.element_size() * world_size > GATHER_MAX_BYTES:
            return reduce(tensor, then)
        rows = tensor.new_empty(world_size * tensor.numel())
        work = all_gather(rows, tensor, async_op=True)
        assert work is not None
        # fut.value() first: it raises when the all-gather failed (a lost peer, a timeout); summing ``rows`` anyway
        # reads uninitialised memory: garbage gradients, and a garbage stop vote taken for a preemption (issue 19)
        return work.get_future().then(lambda fut: (fut.value(), then(rows.view(world_size, -1).sum(0)))[1])

    return total


def mpi_sum(world_size: int) -> Sum:
    """``MPI.Allreduce`` in place (``comm/mpi_transport.py``; ``open_mpi_world`` must have checked the world)."""
    from ddpkit.comm.mpi_transport import mpi_allreduce_sum

    return mpi_allreduce_sum(world_size)


#: Transport name -> maker of its Sum for a world of that many ranks.
TRANSPORTS: dict[str, Callable[[int], Sum]] = {"all-reduce": all_reduce_sum, "gloo-gather": gloo_gather_sum,
                                               "mpi": mpi_sum}


def choose_transport(backend: str, world_size: int) -> str:
    """The transport for a process group of ``backend`` with ``world_size`` ranks."""
    return "gloo-gather" if backend == "gloo" and world_size > 1 else "all-reduce"


def plan_transport(requested: str, *, backend: str, rank: int, world_size: int,
                   environ: Mapping[str, str] | None = None) -> str | None:
    """``--grad-transport`` -> a TRANSPORTS name, or None for the process group's own (``choose_transport``).

    Runs before the process group starts. ``mpi`` (and ``auto`` where it picks MPI) initialises MPI and checks its
    world is torch's (``open_mpi_world``). ``auto`` picks MPI on CPU when an MPI launcher started the ranks and
    mpi4py is installed, and says so once; otherwise it is the process group's own. ConfigError / EnvConflict
    (exit 2) for what cannot work here.
    """
    from ddpkit.comm import mpi_transport
    from ddpkit.env.mpi import mpi_launcher

    environ = os.environ if environ is None else environ
    option = f"--grad-transport {requested}"
    if requested not in GRAD_TRANSPORTS:
        raise ConfigError(f"{option} is unknown", f"one of {', '.join(GRAD_TRANSPORTS)}", "pass --grad-transport auto")
    if requested in ("gloo", "nccl") and backend != requested:
        raise ConfigError(f"{option} with the process-group backend {backend}", f"--backend {requested}",
                          f"pass --backend {requested}, or --grad-transport auto")
    if requested == "mpi":
        if backend != "gloo":
            raise ConfigError(f"{option} with the process-group backend {backend}",
                              "CPU tensors (backend gloo): MPI sums the gradients in host memory",
                              "pass --backend gloo, or --grad-transport nccl on GPUs")
        mpi_transport.check_mpi_usable(option, environ)  # even for one rank: the user asked for MPI
    elif requested in ("gloo", "nccl") or world_size == 1:
        return None
    elif backend != "gloo" or mpi_launcher(environ) is None or not mpi_transport.mpi4py_installed():
        return None  # auto, and MPI is not for this run
    comm = mpi_transport.open_mpi_world(rank, world_size, option=option, tolerate_singleton=requested == "auto")
    if comm is None:  # auto: this MPI sees a world of one (another MPI's library): gloo, as before
        return None
    if rank == 0:
        log.warning("gradients averaged through MPI (%s): %s ranks started by %s; --grad-transport gloo to opt out",
                    mpi_transport.library_name(), world_size, mpi_launcher(environ))
    return "mpi"


class Rider(Protocol):
    """Values summed over the ranks together with the last gradient bucket of every step."""

    def outgoing(self) -> torch.Tensor:
        """This rank's values for this step (a small 1-d tensor)."""

    def arrived(self, total: torch.Tensor) -> None:
        """The sum over the ranks of ``outgoing()``, once the bucket's reduction completes (on its thread)."""


class GradientAveraging:
    """A DDP communication hook: each bucket summed with a transport and divided by the world size; the rider's
    values appended to the last bucket. ``issued`` counts the buckets handed to the transport (read by the watch's
    thread; ``bypasses_group``: the transport's collectives are not the process group's, so the group's sequence
    number does not count them)."""

    def __init__(self, transport: str, world_size: int, rider: Rider | None = None) -> None:
        self.transport = transport
        self.world_size = world_size
        self.rider = rider
        self._sum = TRANSPORTS[transport](world_size)
        self.issued = 0
        self.last_bucket_at = 0.0
        """When this rank last handed its last bucket of a step to the transport (``time.perf_counter``)."""
        self.bypasses_group = transport == "mpi"
        self.about = f"ddpkit's gradient averaging ({transport})"
        """What the watch calls these collectives in a report."""

    def register(self, ddp: Any) -> None:
        """Register ``hook`` on ``ddp``, naming this object as its counter (for the watch: ``Hooks._register``)."""
        # a lambda: DDP rejects string annotations
        hook = lambda state, bucket: self.hook(state, bucket)  # noqa: E731
        hook._ddpkit_counter = self  # type: ignore[attr-defined]
        ddp.register_comm_hook(None, hook)

    def hook(self, _: object, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        self.issued += 1
        grads = bucket.buffer()
        world = self.world_size
        last = bucket.is_last()
        if last:  # this rank's backward is done: from here to backward's return is the sync (goodput.straggler)
            self.last_bucket_at = time.perf_counter()
        if self.rider is None or not last:
            return self._sum(grads, lambda total: total.div_(world))
        rider = self.rider
        extra = rider.outgoing()
        count = extra.numel()

        def unpack(total: torch.Tensor) -> torch.Tensor:
            rider.arrived(total[-count:])
            return total[:-count].div_(world)

        return self._sum(torch.cat([grads, extra.to(grads.dtype)]), unpack)


def register_gradient_averaging(ddp: Any, *, world_size: int, rider: Rider | None = None,
                                transport: str | None = None) -> GradientAveraging | None:
    """Average ``ddp``'s gradients through GradientAveraging, with ``transport`` (default: ``choose_transport``).

    None where the model is above PYTHON_HOOK_MAX_PARAMS (and the transport is not ``mpi``, whose microsecond
    latency pays for the hook at any size): DDP's C++ all-reduce averages, and the rider is not carried (its owner
    must send its values another way). One rank: no hook is registered (nothing to average).
    """
    if transport == "mpi":
        from ddpkit.comm.mpi_transport import MPI_DTYPES

        odd = sorted({str(p.dtype) for p in ddp.module.parameters() if p.dtype not in MPI_DTYPES})
        if odd:
            raise ConfigError(f"--grad-transport mpi with parameters of type {', '.join(odd)}",
                              "float32 or float64 parameters (MPI has no standard half-precision sum)",
                              "use --grad-transport gloo for this model")
    elif sum(p.numel() for p in ddp.module.parameters()) > PYTHON_HOOK_MAX_PARAMS:
        return None
    if transport is None:
        transport = choose_transport(dist.get_backend() if world_size > 1 else "", world_size)
    averaging = GradientAveraging(transport, world_size, rider)
    if world_size > 1:
        averaging.register(ddp)
    return averaging
