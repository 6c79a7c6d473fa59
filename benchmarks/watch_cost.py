"""The watch's added time per DDP step, measured where nothing else moves: one process (a gloo group of one), a
tiny model, so a step is a few hundred microseconds and the watch's per-step work is not lost in communication noise.

    python benchmarks/watch_cost.py --json PATH

Four models, trained in alternating blocks of STEPS steps (the order reversed every block):

- ``cpp``: DDP with no comm hook, unwatched (DDP's C++ all-reduce path);
- ``counted``: DDP with no comm hook, under the watch (it stays on the C++ path; the watch counts its all-reduces
  and marks steps): what a hookless script pays;
- ``hook``: DDP with the script's own Python hook (torch's ``allreduce_hook``), unwatched;
- ``wrapped``: the same hook under the watch (wrapped: each bucket seen): what a script with a Python hook pays
  (ddpkit train's gloo-gather hook on the reference job);
- ``done`` / ``done-wrapped``: a hook whose Future is complete when it returns, unwatched and watched: the shape of
  ddpkit train's MPI transport (``MPI.Allreduce`` in the hook), without MPI;
- ``ours`` / ``ours-counted``: ddpkit's own hook (``comm/gradients.GradientAveraging``, all-reduce transport, as
  ``register_gradient_averaging`` registers it on more than one rank), unwatched and watched: the watch leaves it
  unwrapped and counts it (what ``train`` and ``check`` pay now).

Each block's figure is the main thread's CPU time per step (``time.thread_time``: a rank descheduled by the
machine's other load is not counted; the watch's own thread is not either, and it wakes twice a second) and the
wall time per step. Figures: the median over blocks of the paired difference (counted - cpp, wrapped - hook,
hook - cpp: what torch's Python hook itself costs, which the watch no longer adds to a hookless model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit.comm.gradients import GradientAveraging
from ddpkit.watch import WatchOptions, install, uninstall

PAIRS = {"counted - cpp": ("counted", "cpp"), "wrapped - hook": ("wrapped", "hook"),
         "done-wrapped - done": ("done-wrapped", "done"), "ours-counted - ours": ("ours-counted", "ours"),
         "hook - cpp": ("hook", "cpp")}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def done_hook(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sums in the hook and returns a completed Future, as the MPI transport does (one rank: the sum is the bucket)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _ours(model: DDP) -> DDP:
    """ddpkit's own hook on ``model``, registered as ``register_gradient_averaging`` does for a world above one."""
    GradientAveraging("all-reduce", 1).register(model)
    return model


def _block(model: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return (time.perf_counter() - wall) / steps * 1e6, (time.thread_time() - cpu) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29937"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.randn(32, 20)
    models: dict[str, tuple[DDP, bool]] = {"cpp": (DDP(_net()), False), "hook": (DDP(_net()), False)}
    models["hook"][0].register_comm_hook(None, allreduce_hook)  # registered before any install: unwrapped
    models["done"] = (DDP(_net()), False)
    models["done"][0].register_comm_hook(None, lambda state, bucket: done_hook(state, bucket))
    models["ours"] = (_ours(DDP(_net())), False)
    install(WatchOptions(summary=False))
    counted, wrapped, done_wrapped = DDP(_net()), DDP(_net()), DDP(_net())
    ours_counted = _ours(DDP(_net()))  # under the watch: unwrapped, its all-reduce issued unwatched
    ours_counted(x)
    wrapped.register_comm_hook(None, allreduce_hook)  # wrapped by the installed watch
    done_wrapped.register_comm_hook(None, lambda state, bucket: done_hook(state, bucket))
    counted(x), wrapped(x), done_wrapped(x)  # first forward under the watch: the hookless one is counted from now on
    uninstall()
    models |= {"counted": (counted, True), "wrapped": (wrapped, True), "done-wrapped": (done_wrapped, True),
               "ours-counted": (ours_counted, True)}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, (m, _) in models.items()}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    names = list(models)
    for b in range(args.blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            model, watched = models[name]
            if watched:
                install(WatchOptions(summary=False))
            figures[name].append(_block(model, opts[name], x, args.steps))
            if watched:
                uninstall()
    out: dict[str, object] = {"blocks": args.blocks, "steps_per_block": args.steps, "params": 1409,
                              "step_us": {n: {"wall": statistics.median(f[0] for f in v),
                                              "cpu": statistics.median(f[1] for f in v)} for n, v in figures.items()}}
    added = {}
    for label, (a, b) in PAIRS.items():
        for i, kind in enumerate(("wall", "cpu")):
            diffs = [fa[i] - fb[i] for fa, fb in zip(figures[a], figures[b], strict=True)]
            q = statistics.quantiles(diffs, n=4)
            added[f"{label} {kind}"] = {"median_us": statistics.median(diffs), "p25_us": q[0], "p75_us": q[2]}
    out["added"] = added
    Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
