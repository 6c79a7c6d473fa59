"""A minimal hand-written DDP loop, for benchmarking only: the least a correct DDP training loop does.

Same data (ddpkit's seeded synthetic set), model, sampler order and optimizer as ``ddpkit train``; no snapshots,
no preemption agreement, no statistics. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/minimal_ddp.py --model mlp --epochs 4 --json PATH
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ddpkit.train.data import make_dataset, make_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_dataset(args.model, args.samples, seed=0)
    x_all, y_all = data.tensors
    torch.manual_seed(0)
    model = DDP(make_model(args.model, args.width, args.depth))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    epoch_s = []
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)))
        for idx in order.split(args.batch_size):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x_all[idx]), y_all[idx])
            loss.backward()
            opt.step()
        epoch_s.append(time.perf_counter() - t0)
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump({"epoch_s": epoch_s, "steps_per_epoch": -(-len(order) // args.batch_size)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
