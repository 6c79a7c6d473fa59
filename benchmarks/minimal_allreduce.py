"""An independent all_reduce timing loop, plain torch.distributed, for checking ddpkit bench's figures.

    torchrun --standalone --nproc-per-node 2 benchmarks/minimal_allreduce.py --sizes 1048576,16777216 --iters 20

Two textbook loops per size, each after its own warm-up:
- per-iteration: barrier, time one all_reduce, keep the slowest rank's time of each iteration, average
  (the definition ddpkit bench documents, written again from scratch here);
- back-to-back: barrier, time ``iters`` all_reduces in a row, slowest rank's total / iters (nccl-tests' loop).
busbw = size / time x 2(n-1)/n. Rank 0 prints one JSON line. Deliberately shares no code with ddpkit.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def slowest(seconds: list[float]) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def per_iteration(x: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    worst = slowest(times)
    return sum(worst) / len(worst)


def back_to_back(x: torch.Tensor, iters: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    return slowest([time.perf_counter() - t0])[0] / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    out: dict[str, dict[str, float]] = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        row = {}
        for name, loop in (("per_iteration", per_iteration), ("back_to_back", back_to_back)):
            for _ in range(args.warmup):
                dist.all_reduce(x)
            seconds = loop(x, args.iters)
            row[name] = nbytes / seconds / 1e9 * 2 * (n - 1) / n
        out[str(nbytes)] = row
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
