"""An independent all_reduce timing loop, plain torch.distributed, for checking ddpkit bench's figures.

    torchrun --standalone --nproc-per-node 2 benchmarks/minimal_allreduce.py --sizes 1048576,16777216 --iters 20

The textbook loop: warm up, barrier, time ``iters`` back-to-back all_reduces, take the slowest rank's total,
divide. busbw = size / time x 2(n-1)/n. Rank 0 prints one JSON line. Deliberately shares no code with ddpkit.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    out = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = elapsed.item() / args.iters
        out[str(nbytes)] = {"time_us": seconds * 1e6, "busbw": nbytes / seconds / 1e9 * 2 * (n - 1) / n}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
