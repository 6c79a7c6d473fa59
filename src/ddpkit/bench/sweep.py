"""The measurement loop: every op at every size, timed as nccl-tests times it, the slowest rank defining the time.

Per measurement, after the warm-up, every rank waits at a barrier, then times ``iters`` calls back to back: CUDA
events around the batch on a GPU (the calls are queued on the stream; the events measure their execution), a
monotonic clock on CPU (gloo calls return when done). Each rank's time per call is its batch time / ``iters``;
after the batch, outside the timed region, those are reduced with MAX across ranks, so the slowest rank defines
the op's time. (A barrier before every single call would add each barrier's exit skew to every iteration, which
at small sizes is a large part of the call; nccl-tests times a batch and divides.) Then the op runs once more on
fresh inputs and every rank counts its wrong elements; the counts are summed across ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import first_line
from ddpkit.base.log import get_logger
from ddpkit.bench.busbw import algbw_gbps, busbw_gbps, element_count
from ddpkit.bench.ops import ROOTED, Case, count_wrong, modes, prepare, unsupported_reason

if TYPE_CHECKING:
    import torch

__all__ = ["Measurement", "SweepConfig", "run_sweep", "time_launch"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What to measure."""

    ops: tuple[str, ...]
    """Collectives, in the order they run."""
    sizes: tuple[int, ...]
    """Message sizes in bytes, as nccl-tests counts them."""
    dtype: str = "float32"
    """Element type."""
    redop: str = "sum"
    """Reduction of all_reduce, reduce and reduce_scatter."""
    root: int = 0
    """Root rank of broadcast and reduce."""
    warmup: int = 2
    """Untimed iterations before each measurement."""
    iters: int = 20
    """Timed iterations per measurement."""


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One placement (out-of-place or in-place) of one op at one size."""

    time_us: float
    """Time per call of the slowest rank over a batch of back-to-back calls, microseconds."""
    algbw: float
    """Algorithm bandwidth, GB/s."""
    busbw: float
    """Bus bandwidth, GB/s (nccl-tests' factor)."""
    wrong: int
    """Wrong elements summed over every rank."""

    def as_dict(self) -> dict[str, float | int]:
        return {"time_us": self.time_us, "algbw": self.algbw, "busbw": self.busbw, "wrong": self.wrong}


def _barrier(device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(device_ids=[device.index or 0])
    else:
        dist.barrier()


def time_launch(launch: object, *, warmup: int, iters: int, device: torch.device,
                barrier: Callable[[], object] | None = None) -> float:
    """Seconds per call: the slowest rank's time for ``iters`` back-to-back calls of ``launch``, over ``iters``.

    ``barrier``: the start line of the batch (default the process group's; MPI's for ops through MPI)."""
    import torch
    import torch.distributed as dist

    assert callable(launch)
    for _ in range(warmup):
        launch()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _barrier(device)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            launch()
        end.record()
        torch.cuda.synchronize(device)
        per_call = start.elapsed_time(end) / 1e3 / iters
    else:
        (barrier or (lambda: _barrier(device)))()
        t0 = time.perf_counter()
        for _ in range(iters):
            launch()
        per_call = (time.perf_counter() - t0) / iters
    slowest = torch.tensor([per_call], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _sum_over_ranks(value: int, device: torch.device) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


def _agree_error(message: str | None, device: torch.device) -> str | None:
    """Every rank learns whether any rank failed to run the op, so all skip it together."""
    failed = _sum_over_ranks(1 if message else 0, device)
    return (message or "failed on another rank") if failed else None


def measure_op(op: str, cfg: SweepConfig, *, rank: int, world_size: int, backend: str,
               device: torch.device, mpi_comm: Any = None) -> dict[str, Any]:
    """Rows of one op across the sizes, or the reason it cannot run on this backend.

    With ``mpi_comm`` (``bench --transport mpi``), the op runs through MPI on the same buffers and is verified the
    same way (bench/mpi_ops.py); the result then carries ``"transport": "mpi"``.
    """
    import torch
    import torch.distributed as dist

    from ddpkit.bench.mpi_ops import mpi_unsupported_reason, prepare_mpi

    barrier = mpi_comm.Barrier if mpi_comm is not None else None
    reason = unsupported_reason(op, backend, world_size, device.type)
    if mpi_comm is not None:
        reason = mpi_unsupported_reason(cfg.dtype, device.type) or (reason if op == "sendrecv" else None)
        backend = "MPI"
    result: dict[str, Any] = {"op": op, "supported": reason is None, "reason": reason, "rows": []}
    if mpi_comm is not None:
        result["transport"] = "mpi"
    if reason:
        return result
    itemsize = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    rows: list[dict[str, object]] = []
    for nbytes in cfg.sizes:
        count = element_count(op, nbytes, itemsize, world_size)
        if count == 0:
            continue
        row: dict[str, object] = {"size": count * itemsize, "count": count, "type": cfg.dtype,
                                  "redop": cfg.redop if op in ("all_reduce", "reduce", "reduce_scatter") else None,
                                  "root": cfg.root if op in ROOTED else None,
                                  "out_of_place": None, "in_place": None}
        for in_place in modes(op):
            case = Case(op=op, count=count, dtype=cfg.dtype, redop=cfg.redop, root=cfg.root, rank=rank,
                        world_size=world_size, in_place=in_place)
            error: str | None = None
            try:
                prepared = prepare(case, device) if mpi_comm is None else prepare_mpi(case, device, mpi_comm)
                prepared.reset()
                seconds = time_launch(prepared.launch, warmup=cfg.warmup, iters=cfg.iters, device=device,
                                      barrier=barrier)
                wrong = count_wrong(case, prepared, device)
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                if isinstance(exc, dist.DistBackendError):  # a timeout or a lost peer: not a missing feature
                    raise
                error = f"unsupported by {backend}: {first_line(exc)[:160]}"
            error = _agree_error(error, device)
            if error:
                log.warning("%s: %s", op, error)
                return {**result, "supported": False, "reason": error, "rows": []}
            wrong_total = _sum_over_ranks(wrong, device)
            size = count * itemsize
            m = Measurement(time_us=seconds * 1e6, algbw=algbw_gbps(size, seconds),
                            busbw=busbw_gbps(op, size, seconds, world_size), wrong=wrong_total)
            row["in_place" if in_place else "out_of_place"] = m.as_dict()
        rows.append(row)
    result["rows"] = rows
    return result


def run_sweep(cfg: SweepConfig, *, rank: int, world_size: int, backend: str,
              device: torch.device, mpi_comm: Any = None) -> list[dict[str, Any]]:
    """Every op of ``cfg`` over every size (through MPI with ``mpi_comm``); the same list on every rank."""
    return [measure_op(op, cfg, rank=rank, world_size=world_size, backend=backend, device=device, mpi_comm=mpi_comm)
            for op in cfg.ops]
