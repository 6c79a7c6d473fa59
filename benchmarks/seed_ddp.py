"""A faithful re-implementation of the seeds' ``ddp.py`` loop (pytorch/examples ddp-tutorial-series shape), for
benchmarking only: per-sample Dataset + DataLoader + DistributedSampler, Linear(20, 1), SGD lr 1e-3, the seeds'
``cross_entropy`` loss on one output (always 0; the compute is the same as a real loss), a snapshot of the
weights every SAVE_EVERY epochs. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/seed_ddp.py EPOCHS SAVE_EVERY [--json PATH]

Prints the seeds' lines, and with --json the per-epoch loop times (startup excluded) for bench_train.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class MyTrainDataset(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str) -> None:
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.epoch_s: list[float] = []

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK {self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            t0 = time.perf_counter()
            self._run_epoch(epoch)
            self.epoch_s.append(time.perf_counter() - t0)
            if epoch % self.save_every == 0 and self.save_every <= max_epochs:
                self._save_snapshot(epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    parser.add_argument("--samples", default=2048, type=int)
    parser.add_argument("--snapshot_path", default="/tmp/seed_snapshot.pt")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    dataset = MyTrainDataset(args.samples)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=args.batch_size, pin_memory=True, shuffle=False,
                        sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, args.save_every, args.snapshot_path)
    trainer.train(args.total_epochs)
    if args.json and trainer.global_rank == 0:
        with open(args.json, "w") as f:
            json.dump({"epoch_s": trainer.epoch_s, "steps_per_epoch": len(loader)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
