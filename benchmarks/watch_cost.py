"""The watch's added time per DDP step, measured where nothing else moves: one process (a gloo group of one), a
tiny model, so a step is a few hundred microseconds and the watch's per-step work (the forward wrapper, the
wrapped comm hook per bucket, the monitor thread's share) is not lost in communication noise.

    python benchmarks/watch_cost.py --json PATH

Blocks of STEPS steps alternate: unwatched (torch's functions; the model's own Python all-reduce hook) and watched
(``ddpkit.watch.install``; the same hook, wrapped). Both models carry the same hook, so the difference is the
watch's wrapper and thread alone. Figure: the median over blocks of (watched - unwatched) microseconds per step.
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

from ddpkit.watch import WatchOptions, install, uninstall


def _block(model: DDP, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29937"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)

    def make() -> tuple[DDP, torch.optim.Optimizer]:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        model.register_comm_hook(None, allreduce_hook)  # unwatched: registered before any install, unwrapped
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    plain, plain_opt = make()
    x = torch.randn(32, 20)
    session = install(WatchOptions(summary=False))
    watched = DDP(torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    watched.register_comm_hook(None, allreduce_hook)  # wrapped by the installed watch
    watched_opt = torch.optim.SGD(watched.parameters(), lr=1e-3)
    uninstall()
    del session
    per_step: dict[str, list[float]] = {"plain": [], "watched": []}
    for b in range(args.blocks):
        for side in (("plain", "watched") if b % 2 == 0 else ("watched", "plain")):
            if side == "watched":
                install(WatchOptions(summary=False))
                per_step[side].append(_block(watched, watched_opt, x, args.steps))
                uninstall()
            else:
                per_step[side].append(_block(plain, plain_opt, x, args.steps))
    added = [(w - p) * 1e6 for w, p in zip(per_step["watched"], per_step["plain"], strict=True)]
    Path(args.json).write_text(json.dumps({
        "blocks": args.blocks, "steps_per_block": args.steps,
        "plain_step_us": statistics.median(per_step["plain"]) * 1e6,
        "watched_step_us": statistics.median(per_step["watched"]) * 1e6,
        "added_us_per_step": statistics.median(added), "added_us_per_block": added}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
