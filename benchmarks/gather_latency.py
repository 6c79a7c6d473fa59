"""gloo all-reduce against all-gather + a local sum in rank order (the trainer's hook for small buckets), alternated
in the same processes, per size.

    torchrun --standalone --nproc-per-node 2 benchmarks/gather_latency.py --rounds 8 --json PATH

Rank 0 writes, per float count, both series of seconds per call (each a back-to-back batch after a barrier).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.comm.torch_compat import all_gather_single

COUNTS = (23, 1024, 16384, 65536, 262144)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    gather = all_gather_single()
    out: dict[int, dict[str, list[float]]] = {}
    for count in COUNTS:
        x = torch.rand(count)
        rows = torch.empty(world * count)
        series: dict[str, list[float]] = {"all_reduce": [], "all_gather_sum": []}
        for r in range(args.rounds):
            for side in (("all_reduce", "all_gather_sum") if r % 2 == 0 else ("all_gather_sum", "all_reduce")):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    if side == "all_reduce":
                        dist.all_reduce(x)
                    else:
                        gather(rows, x)
                        rows.view(world, -1).sum(0)
                series[side].append((time.perf_counter() - t0) / args.iters)
        out[count] = series
    if dist.get_rank() == 0:
        Path(args.json).write_text(json.dumps({"world_size": world, "seconds": out}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
