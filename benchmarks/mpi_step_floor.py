"""Worker for benchmarks/bench_mpi.py, run under ``mpirun -np 2``: where the default job's step time goes, in the
same processes, alternating rounds. The seeds' Linear(20,1), batch 32, SGD, MSE:

- ``local``: the step with no DDP and no communication at all (the floor any transport stands on);
- ``ddp_mpi``: DDP with ddpkit's gradient hook and the ``mpi`` transport (what ``--grad-transport mpi`` runs);
- ``ddp_gloo_gather``: DDP with ddpkit's hook and the ``gloo-gather`` transport (``--grad-transport gloo``);
- ``ddp_allreduce``: DDP's own gloo all-reduce, no hook (the baseline of the issue's 7.3x);
- ``ddp_noop``: DDP with a hook that hands each bucket back untouched: DDP's reducer, a Python hook and its
  Future with no transport at all (the floor of any transport through DDP's hook API; replicas not averaged);
- ``ddp_mpi_static``: ``ddp_mpi`` with ``static_graph=True`` (DDP skips some per-step work for a fixed graph);
- ``flat_mpi``: no DDP: gradients as views of one flat buffer, one ``MPI.Allreduce`` after ``backward`` (what a
  step through MPI costs without DDP's reducer; not something ddpkit runs).

Prints one RESULT line on rank 0: per variant the median over rounds of each round's median step, in us.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm.gradients import register_gradient_averaging
from ddpkit.comm.mpi_transport import open_mpi_world

ROUNDS, STEPS, GLOO_STEPS = 15, 400, 100


def _timed(step: Callable[[], None], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    comm = open_mpi_world(rank, world)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getppid() % 1000))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 20, generator=g), torch.randn(32, 1, generator=g)
    mse = torch.nn.MSELoss()
    steps: dict[str, Callable[[], None]] = {}

    def sgd_step(model: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            mse(forward(x), y).backward()
            opt.step()
        return step

    local = torch.nn.Linear(20, 1)
    steps["local"] = sgd_step(local, local)
    for name, transport in (("ddp_mpi", "mpi"), ("ddp_gloo_gather", "gloo-gather"), ("ddp_allreduce", None)):
        ddp = DDP(torch.nn.Linear(20, 1), gradient_as_bucket_view=True)
        if transport is not None:
            register_gradient_averaging(ddp, world_size=world, transport=transport)
        steps[name] = sgd_step(ddp, ddp)
    static = DDP(torch.nn.Linear(20, 1), gradient_as_bucket_view=True, static_graph=True)
    register_gradient_averaging(static, world_size=world, transport="mpi")
    steps["ddp_mpi_static"] = sgd_step(static, static)
    noop = DDP(torch.nn.Linear(20, 1), gradient_as_bucket_view=True)

    def untouched(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    noop.register_comm_hook(None, lambda state, bucket: untouched(state, bucket))  # DDP reads real annotations
    steps["ddp_noop"] = sgd_step(noop, noop)
    flat_model = torch.nn.Linear(20, 1)
    flat = torch.zeros(sum(p.numel() for p in flat_model.parameters()))
    start = 0
    for p in flat_model.parameters():
        p.grad = flat[start:start + p.numel()].view_as(p)
        start += p.numel()
    flat_opt, view = torch.optim.SGD(flat_model.parameters(), lr=0.01), flat.numpy()

    def flat_step() -> None:
        flat.zero_()
        mse(flat_model(x), y).backward()
        comm.Allreduce(MPI.IN_PLACE, view)
        flat.div_(world)
        flat_opt.step()
    steps["flat_mpi"] = flat_step
    for step in steps.values():  # warm-up: DDP builds its buckets on the first steps
        for _ in range(20):
            step()
    rounds: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(ROUNDS):
        order = list(steps) if r % 2 == 0 else list(reversed(steps))
        for name in order:
            rounds[name].append(_timed(steps[name], GLOO_STEPS if "gloo" in name or "allreduce" in name else STEPS))
    dist.barrier()
    if rank == 0:
        print("RESULT " + json.dumps({k: statistics.median(v) for k, v in rounds.items()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
