"""The seeds' bare hello world, as the baseline for `ddpkit check`'s wall time (benchmarks/bench_check.py).

    torchrun --standalone --nproc-per-node 2 benchmarks/baseline_hello.py

torchrun + init_process_group + one print per rank, and nothing verified: what seeds 002-004 do.
"""

from __future__ import annotations

import os
import socket

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    print(f"{socket.gethostname()}: {dist.get_rank()} of {dist.get_world_size()} "
          f"(LOCAL_RANK={os.environ.get('LOCAL_RANK')})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
