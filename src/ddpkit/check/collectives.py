"""Verified collectives: each result is compared, element by element, with its closed-form expected value.

Rank ``r`` contributes ``(i % 7) + (r % 13 + 1)`` at element ``i`` (``ddpkit.comm.closed_form.CHECK``: small
integers, exact in float32 for any world size that fits a cluster), so every expected result is a sum, a max or a
copy of known integers. An op the backend does not implement is reported as "not supported by <backend>", never a crash.
Each op returns this rank's ``OpResult``; rank 0 combines them across ranks (``combine``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import first_line
from ddpkit.base.fault_injection import fault
from ddpkit.comm.closed_form import CHECK, mismatches
from ddpkit.verdicts.outcome import PASS, SKIP, Outcome, failed

if TYPE_CHECKING:
    import torch

__all__ = ["COUNT", "OPS", "OpResult", "combine", "roots", "run_op"]

COUNT = 1024  # elements per rank per op: small, the point is correctness, not bandwidth (see ddpkit bench)
_UNSUPPORTED = ("not supported", "does not support", "unsupported", "not implemented")


@dataclass(frozen=True, kw_only=True)
class OpResult:
    """One op's result on one rank."""

    op: str
    status: str
    """ok, wrong, unsupported (by the backend), skipped (not applicable to this world), or error."""
    wrong: int = 0
    total: int = 0
    first: str = ""
    """The first wrong element: index, value found, value expected."""
    seconds: float = 0.0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def roots(world_size: int) -> list[int]:
    """Every root on small worlds; on large ones a sample that still covers both ends and the middle."""
    if world_size <= 8:
        return list(range(world_size))
    return sorted({0, 1, world_size // 2, world_size - 1})


def _value(rank: int) -> torch.Tensor:
    """Rank ``rank``'s input (float32 on the CPU)."""
    return CHECK.of_rank(rank, COUNT)


def _sum_over(world: int) -> torch.Tensor:
    """The closed-form sum of every rank's input."""
    return CHECK.reduced(CHECK.base(COUNT), "sum", world)


def _corrupt(op: str, rank: int, out: torch.Tensor) -> None:
    """Test hook: ``DDPKIT_FAULTS=corrupt:op=OP:rank=R`` makes rank R's result of OP wrong in one element."""
    if fault("corrupt", op=op, rank=rank) is not None:
        out.view(-1)[3] += 1


def _all_reduce(op_name: str, reduce: str) -> Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    def run(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        import torch
        import torch.distributed as dist

        ranks = torch.arange(world)
        if reduce == "max":  # a different rank holds the max of each element
            x = ((rank + torch.arange(COUNT)) % (world + 3)).float()
            expected = ((ranks[:, None] + torch.arange(COUNT)) % (world + 3)).float().amax(0)
            op = dist.ReduceOp.MAX
        else:
            x = _value(rank)
            expected = _sum_over(world)
            op = dist.ReduceOp.SUM
        out = x.to(device)
        dist.all_reduce(out, op=op)
        _corrupt(op_name, rank, out)
        return out, expected
    return run


def _broadcast(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    import torch.distributed as dist

    got, want = [], []
    for root in roots(world):
        t = (_value(root) if rank == root else torch.full((COUNT,), -1.0)).to(device)
        dist.broadcast(t, src=root)
        got.append(t)
        want.append(_value(root))
    out = torch.cat(got)
    _corrupt("broadcast", rank, out)
    return out, torch.cat(want)


def _reduce(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    import torch.distributed as dist

    got, want = [], []
    total = _sum_over(world)
    for root in roots(world):
        t = _value(rank).to(device)
        dist.reduce(t, dst=root)
        if rank == root:  # only the root's result is defined
            got.append(t)
            want.append(total)
    out, expected = (torch.cat(got), torch.cat(want)) if got else (torch.zeros(0), torch.zeros(0))
    _corrupt("reduce", rank, out)
    return out, expected


def _all_gather(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    import torch.distributed as dist

    outs = [torch.zeros(COUNT, device=device) for _ in range(world)]
    dist.all_gather(outs, _value(rank).to(device))
    out = torch.cat(outs)
    _corrupt("all_gather", rank, out)
    return out, torch.cat([_value(k) for k in range(world)])


def _chunks(src: int, world: int) -> torch.Tensor:
    """What rank ``src`` sends to each rank ``dst`` in reduce_scatter / all_to_all: world x COUNT, distinct rows."""
    import torch

    return _value(src) + 100 * torch.arange(world, dtype=torch.float32)[:, None]


def _received(dst: int, world: int) -> torch.Tensor:
    """Row ``dst`` of every rank's ``_chunks``, world x COUNT, in closed form: building every sender's whole
    world x COUNT matrix to take one row of it cost O(world^2) per rank (4.3 s of the check at 32 ranks)."""
    import torch

    return torch.stack([_value(k) for k in range(world)]) + 100 * dst


def _reduce_scatter(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    from ddpkit.comm.torch_compat import reduce_scatter_single

    out = torch.zeros(COUNT, device=device)
    # the flat-tensor form, as FSDP calls it: gloo's list form took 1.0 s at 16 ranks, 6.6 s at 32 and 41 s at 64
    # here (the flat form 0.07, 0.29 and 0.68 s; torchrun, gloo, 1024 floats per rank, 2 shared cores)
    reduce_scatter_single()(out, _chunks(rank, world).reshape(-1).to(device))
    _corrupt("reduce_scatter", rank, out)
    return out, _received(rank, world).sum(0)


def _all_to_all(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    import torch.distributed as dist

    outs = [torch.zeros(COUNT, device=device) for _ in range(world)]
    dist.all_to_all(outs, list(_chunks(rank, world).to(device).unbind(0)))
    out = torch.cat(outs)
    _corrupt("all_to_all", rank, out)
    return out, _received(rank, world).reshape(-1)


def _send_recv_ring(rank: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    import torch.distributed as dist

    left, right = (rank - 1) % world, (rank + 1) % world
    out = torch.full((COUNT,), -1.0, device=device)
    reqs = [dist.isend(_value(rank).to(device), dst=right), dist.irecv(out, src=left)]
    for req in reqs:
        if req is not None:
            req.wait()
    _corrupt("send_recv_ring", rank, out)
    return out, _value(left)


def _barrier(rank: int, world: int, device: torch.device, timeout: float = 30.0) -> tuple[torch.Tensor, torch.Tensor]:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "gloo":  # names the ranks that did not arrive, where plain barrier just times out
        dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    else:
        dist.barrier()
    return torch.zeros(0), torch.zeros(0)


Op = Callable[[int, int, "torch.device"], tuple["torch.Tensor", "torch.Tensor"]]
OPS: dict[str, Op] = {
    "barrier": _barrier,
    "all_reduce_sum": _all_reduce("all_reduce_sum", "sum"),
    "all_reduce_max": _all_reduce("all_reduce_max", "max"),
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "send_recv_ring": _send_recv_ring,
}


def run_op(name: str, rank: int, world: int, device: torch.device) -> OpResult:
    """Run one op on this rank and verify it; unsupported ops and errors become results, not exceptions."""
    import torch

    if name == "send_recv_ring" and world == 1:
        return OpResult(op=name, status="skipped", error="a ring needs at least 2 ranks")
    start = time.perf_counter()
    try:
        out, expected = OPS[name](rank, world, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        text = first_line(exc)
        status = "unsupported" if any(s in text.lower() for s in _UNSUPPORTED) else "error"
        return OpResult(op=name, status=status, error=text[:300], seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    wrong, first = mismatches(out, expected, world)
    return OpResult(op=name, status="wrong" if wrong else "ok", wrong=wrong, total=int(expected.numel()),
                    first=first, seconds=seconds)


def combine(name: str, per_rank: Sequence[OpResult], backend: str) -> Outcome:
    """One line for ``name`` from every rank's result: the ranks whose results were wrong are named."""
    by_status: dict[str, list[int]] = {}
    for rank, res in enumerate(per_rank):
        by_status.setdefault(res.status, []).append(rank)
    seconds = max(r.seconds for r in per_rank)
    if set(by_status) == {"unsupported"}:
        return Outcome(name=name, status=SKIP, detail=f"not supported by {backend} ({per_rank[0].error})")
    if set(by_status) == {"skipped"}:
        return Outcome(name=name, status=SKIP, detail=per_rank[0].error)
    wrong = by_status.get("wrong", [])
    errors = by_status.get("error", []) + (by_status.get("unsupported", []) if len(by_status) > 1 else [])
    if wrong or errors:
        parts = [f"rank {r}: {per_rank[r].wrong} of {per_rank[r].total} elements wrong, first {per_rank[r].first}"
                 for r in wrong]
        parts += [f"rank {r}: {per_rank[r].status}: {per_rank[r].error}" for r in errors]
        return failed(name, f"wrong on rank(s) {sorted(wrong + errors)}: " + "; ".join(parts),
                      bad_ranks=wrong + errors, seconds=seconds)
    total = sum(r.total for r in per_rank)
    what = "completed on every rank" if total == 0 else f"{total} elements verified on {len(per_rank)} ranks"
    return Outcome(name=name, status=PASS, detail=f"{what}, {seconds * 1e3:.1f} ms",
                   seconds=seconds)
