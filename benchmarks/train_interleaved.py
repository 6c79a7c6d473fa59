"""ddpkit train's default job and the seeds' ddp.py loop, alternated in the same two processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/train_interleaved.py --rounds 15 --json PATH

Each round runs one block of each side, the order swapped every round. A block builds its trainer afresh (the
seeds' ``Trainer`` from benchmarks/seed_ddp.py with its per-sample Dataset + DataLoader + DistributedSampler; ddpkit's
``Trainer(builtin_job(...), TrainConfig(...))``, exactly what ``ddpkit train`` runs on every rank), so both pay
the same DDP construction, and trains ``--epochs`` epochs; the first epoch of a block (DDP's bucket rebuild after
its first step) is excluded and the block's figure is its median epoch. The two blocks of a round are about a
second apart and share the same processes, cores and gloo connections, so the machine's load drift and the luck
of process placement cancel out of the paired ratio (ddpkit samples/s / seeds' samples/s).
Rank 0 writes the per-round epoch times of both sides as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddpkit
from benchmarks.seed_ddp import MyTrainDataset
from benchmarks.seed_ddp import Trainer as SeedTrainer
from ddpkit.train.config import TrainConfig
from ddpkit.train.jobs import builtin_job
from ddpkit.train.trainer import Trainer


def _seed_block(model: torch.nn.Module, loader: DataLoader, epochs: int) -> list[float]:
    trainer = SeedTrainer(model, loader, torch.optim.SGD(model.parameters(), lr=1e-3), 1000, "/nonexistent")
    trainer.train(epochs)
    return trainer.epoch_s


def _ddpkit_block(rt: ddpkit.Runtime, epochs: int) -> list[float]:
    config = TrainConfig(epochs=epochs, progress=False)
    summary = Trainer(builtin_job(config), config, rt).fit()
    return [summary.epoch_s[e] for e in sorted(summary.epoch_s)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    rt = ddpkit.init(backend="gloo")
    dataset = MyTrainDataset(2048)
    seed_model = torch.nn.Linear(20, 1)
    loader = DataLoader(dataset, batch_size=32, pin_memory=True, shuffle=False, sampler=DistributedSampler(dataset))
    blocks: dict[str, list[list[float]]] = {"ddpkit": [], "seed": []}
    for r in range(args.rounds):
        order = ("seed", "ddpkit") if r % 2 == 0 else ("ddpkit", "seed")
        for side in order:
            dist.barrier()
            with contextlib.redirect_stdout(io.StringIO()):  # both print their per-epoch lines
                times = _seed_block(seed_model, loader, args.epochs) if side == "seed" else \
                    _ddpkit_block(rt, args.epochs)
            blocks[side].append(times)
    if rt.rank == 0:
        rate = {side: [2048 / statistics.median(t[1:]) for t in blocks[side]] for side in blocks}
        ratios = [a / b for a, b in zip(rate["ddpkit"], rate["seed"], strict=True)]
        Path(args.json).write_text(json.dumps({"epoch_s": blocks, "samples_per_s": rate, "ratios": ratios,
                                               "epochs_per_block": args.epochs}))
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
