"""ddpkit bench's measurement code and the independent minimal loop, alternated in the same two processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/fidelity_interleaved.py --sizes 1048576 --rounds 9

Each round, at each size: ddpkit's own code path (``ddpkit.bench.ops.prepare`` + ``ddpkit.bench.sweep.time_launch``,
what ``ddpkit bench`` runs on every rank) and then ``benchmarks/minimal_allreduce.py``'s back-to-back loop (each
after its own warm-up; the order swapped every round), seconds apart at most, so the machine's load drift
cancels out of the paired ratio.
Rank 0 prints one JSON line: per size, both busbw series.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.minimal_allreduce import back_to_back
from ddpkit.bench.ops import Case, prepare
from ddpkit.bench.sweep import time_launch


def _seconds(side: str, case: Case, iters: int, warmup: int) -> float:
    if side == "ddpkit":
        prepared = prepare(case, torch.device("cpu"))
        prepared.reset()
        return time_launch(prepared.launch, warmup=warmup, iters=iters, device=torch.device("cpu"))
    x = torch.ones(case.count, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(x)
    return back_to_back(x, iters)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    factor = 2 * (n - 1) / n
    out: dict[str, dict[str, list[float]]] = {}
    for nbytes in (int(s) for s in args.sizes.split(",")):
        case = Case(op="all_reduce", count=nbytes // 4, dtype="float32", redop="sum", root=0, rank=rank,
                    world_size=n, in_place=True)
        series: dict[str, list[float]] = {"ddpkit": [], "minimal": []}
        for round_no in range(args.rounds):
            for side in (("minimal", "ddpkit") if round_no % 2 else ("ddpkit", "minimal")):
                series[side].append(nbytes / _seconds(side, case, args.iters, args.warmup) / 1e9 * factor)
        out[str(nbytes)] = series
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
