"""Worker for tests/multiproc/test_train_hook.py: the trainer's DDP communication hook on a real gloo world.

Each rank runs the same steps three times on the same seeded model: with the hook on its all-gather path, with the
hook forced onto its all-reduce path, and with DDP's own C++ all-reduce (no hook). Rank r's data is seeded by r,
so every rank can also compute the exact average gradient locally. Rank 1 raises its stop flag before step 2.
Rank 0 prints one RESULT line.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit import runtime
from ddpkit.comm.gradients import register_gradient_averaging
from ddpkit.process.exiting import leave
from ddpkit.train.data import make_model
from ddpkit.train.faults import PreemptionWatch

rt = runtime.init(backend="gloo")
world = rt.world_size


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 10, generator=g), torch.randn(8, 5, generator=g)


def run(mode: str) -> dict[str, object]:
    torch.manual_seed(3)
    model = make_model("toy")
    ddp = DDP(model, gradient_as_bucket_view=True)
    watch = PreemptionWatch((), torch.device("cpu"), world)
    averaging = None
    if mode != "c++":
        averaging = register_gradient_averaging(ddp, world_size=world, rider=watch,
                                                transport="all-reduce" if mode == "all-reduce" else None)
        watch.rides_gradients(averaging is not None)
    grads, exact, stops = [], [], []
    for step in range(3):
        if step == 2 and rt.rank == 1 and mode != "c++":
            watch.received = "SIGTERM"
        ddp.zero_grad(set_to_none=True)
        x, y = batch(rt.rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        grads.append(got)
        mean = torch.zeros_like(got)
        for r in range(world):  # the exact average, computed locally from every rank's data
            reference = make_model("toy")
            reference.load_state_dict(model.state_dict())
            torch.nn.functional.mse_loss(reference(batch(r, step)[0]), batch(r, step)[1]).backward()
            mean += torch.cat([p.grad.flatten() for p in reference.parameters()]) / world
        exact.append(float((got - mean).abs().max()))
        if mode != "c++":
            stops.append(watch.should_stop(step + 1))
    every_step = torch.stack(grads).flatten()
    rows = [torch.empty_like(every_step) for _ in range(world)]
    dist.all_gather(rows, every_step)
    gather = averaging is not None and averaging.transport == "gloo-gather"
    return {"gather": gather, "max_error": max(exact), "stops": stops,
            "ranks_identical": all(torch.equal(rows[0], row) for row in rows), "grads": torch.stack(grads)}


results = {mode: run(mode) for mode in ("all-gather", "all-reduce", "c++")}
if rt.rank == 0:
    same_as_cpp = {mode: float((results[mode]["grads"] - results["c++"]["grads"]).abs().max())  # type: ignore[operator]
                   for mode in ("all-gather", "all-reduce")}
    for r in results.values():
        r.pop("grads")
    print("RESULT " + json.dumps({"world_size": world, "modes": results, "vs_cpp": same_as_cpp}), flush=True)
# every rank is done with its DDP instances before any tears the group down: without it, about 1 run in 8 here had
# a rank abort in teardown ("terminate called without an active exception") after all results were in
dist.barrier()
runtime.shutdown()
# and it leaves as every ddpkit process does (process.exiting.leave: atexit handlers, a flush, then os._exit): the
# interpreter's teardown under torch 2.13's gloo still aborted a rank that had finished (CI, 1 run in many)
leave(0)
