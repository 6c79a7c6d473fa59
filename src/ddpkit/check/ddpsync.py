"""DDP really synchronises: a few steps of a small model under DistributedDataParallel, on rank-dependent data.

Afterwards every rank's parameters must be identical (bit for bit: DDP applies the same averaged gradients
everywhere), and equal, within ``ATOL + RTOL * |reference|``, to what one process computes on the union of
every rank's batches (DDP's averaged gradient of per-rank mean losses equals the gradient of the mean loss
over the union when batches are equal-sized). The check also proves it can fail: training on this rank's
data alone must land measurably away from the reference.

Each rank's targets are offset by a bounded, rank-dependent amount (``_offset``): different data per rank, so
the check has power, but a union whose spread does not grow with the world. (Offsets growing with the rank made
the world's mean target about N/2: at 32 ranks rank 0's loss went 0.93 -> 349.9 in five steps while the model
chased the union.) The loss reported is the world's mean over ranks, the loss DDP actually minimises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ddpkit.base.fault_injection import fault
from ddpkit.verdicts.outcome import PASS, Outcome, failed

if TYPE_CHECKING:
    import torch

__all__ = ["ATOL", "RTOL", "DdpResult", "combine", "reference_losses", "run_ddp"]

ATOL, RTOL = 1e-5, 1e-4
STEPS, BATCH, LR, SEED = 5, 8, 0.1, 1234


@dataclass(frozen=True, kw_only=True)
class DdpResult:
    """This rank's view after the DDP steps."""

    params: int
    max_diff_ranks: float
    """Largest |parameter difference| between this rank and rank 0."""
    max_diff_reference: float
    """Largest |difference| from the single-process reference, beyond what the tolerance allows is a failure."""
    within_tolerance: bool
    local_only_diff: float
    """How far training on this rank's data alone would land from the reference: the check's power to fail."""
    loss_first: float
    """The world's mean loss (over every rank's batch) at the first step."""
    loss_last: float
    """The world's mean loss at the last step."""
    loss_falls: bool = True
    """Whether the world's mean loss went down at every step."""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _model() -> torch.nn.Module:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))  # the seeds' ToyModel


def _offset(rank: int) -> float:
    """A rank-dependent shift of the targets, bounded (-0.5..0.5) whatever the world size."""
    return ((rank % 5) - 2) * 0.25


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch; the same every step, so the falling loss shows the model learns."""
    import torch

    g = torch.Generator().manual_seed(SEED + rank)
    return torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 5, generator=g) + _offset(rank)


def reference_losses(world: int) -> tuple[list[float], torch.Tensor]:
    """One process on the union of every rank's batch: the loss per step and the parameters DDP must reach."""
    import torch

    batches = [_batch(r) for r in range(world)]
    union = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    model = _model()
    losses = _train(model, [union] * STEPS, torch.device("cpu"))
    return losses, _flat(model)


def _train(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
           device: torch.device) -> list[float]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.detach().item())
    return losses


def _flat(model: torch.nn.Module) -> torch.Tensor:
    import torch

    return torch.cat([p.detach().to("cpu").reshape(-1) for p in model.parameters()])


def run_ddp(rank: int, world: int, device: torch.device, transport: str | None = None) -> DdpResult:
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    start = time.perf_counter()
    model = _model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if transport is not None:  # the gradient path train uses (e.g. "mpi"): verify that one
        from ddpkit.comm.gradients import register_gradient_averaging

        register_gradient_averaging(ddp, world_size=world, transport=transport)
    losses = _train(ddp, [_batch(rank)] * STEPS, device)
    mine = _flat(model)
    if fault("corrupt", op="ddp", rank=rank) is not None:  # test hook: a replica drifts
        mine[3] += 1e-3
    # one all_gather carries the parameters (compared with rank 0's) and the losses (the world's mean per step)
    packed = torch.cat([mine, torch.tensor(losses, dtype=mine.dtype)]).to(device)
    gathered = [torch.zeros_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed)
    seconds = time.perf_counter() - start

    n = mine.numel()
    world_losses = torch.stack([g.to("cpu")[n:] for g in gathered]).mean(dim=0).tolist()
    _, ref = reference_losses(world)
    local = _model()
    _train(local, [_batch(rank)] * STEPS, torch.device("cpu"))
    diff = (mine - ref).abs()
    return DdpResult(
        params=int(n),
        max_diff_ranks=float((mine - gathered[0].to("cpu")[:n]).abs().max()),
        max_diff_reference=float(diff.max()),
        within_tolerance=bool((diff <= ATOL + RTOL * ref.abs()).all()),
        local_only_diff=float((_flat(local) - ref).abs().max()),
        loss_first=world_losses[0], loss_last=world_losses[-1],
        loss_falls=all(b < a for a, b in pairwise(world_losses)), seconds=seconds,
    )


def combine(per_rank: list[DdpResult]) -> Outcome:
    name = "ddp-sync"
    seconds = max(r.seconds for r in per_rank)
    desync = [rank for rank, r in enumerate(per_rank) if r.max_diff_ranks != 0.0]
    off = [rank for rank, r in enumerate(per_rank) if not r.within_tolerance]
    worst_ref = max(r.max_diff_reference for r in per_rank)
    tol = f"tolerance {ATOL:g} + {RTOL:g}*|ref|"
    if desync or off:
        parts = [f"rank {r}: differs from rank 0 by up to {per_rank[r].max_diff_ranks:.3g}" for r in desync]
        parts += [f"rank {r}: differs from the single-process reference by {per_rank[r].max_diff_reference:.3g} "
                  f"({tol})" for r in off]
        return failed(name, "replicas out of sync: " + "; ".join(parts), bad_ranks=desync + off, seconds=seconds,
                      data={"per_rank": [r.as_dict() for r in per_rank]})
    power = min(r.local_only_diff for r in per_rank)
    if len(per_rank) > 1 and power <= ATOL:
        return failed(name, f"the check cannot tell synchronised from unsynchronised training (local-only runs land "
                      f"{power:.3g} from the reference)", seconds=seconds)
    r0 = per_rank[0]
    trend = "falling every step" if r0.loss_falls else "NOT falling every step"
    return Outcome(name=name, status=PASS, seconds=seconds,
                   detail=f"{r0.params} params identical on {len(per_rank)} ranks after {STEPS} steps; max |diff| "
                          f"to 1-process reference {worst_ref:.2g} ({tol}); world mean loss {r0.loss_first:.3f} -> "
                          f"{r0.loss_last:.3f} ({trend}); {seconds:.2f} s",
                   data={"per_rank": [r.as_dict() for r in per_rank]})
