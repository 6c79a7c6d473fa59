"""The seeds' ``ddp.py`` (pytorch/examples' ddp-tutorial-series ``multigpu_torchrun.py``, CPU/gloo) with the change
docs/heal.md documents for ``ddpkit run --heal live``: ``live.Replica`` after ``DDP(...)``, and the epoch loop, the
batch loop and the step through it (the lines marked ``# live``). At the end each rank prints a digest of its weights
(for the test, not part of the change)."""
# ruff: noqa
import os, hashlib
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group
from ddpkit.run import live  # live


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)
        self.replica = live.Replica(self.model, self.optimizer)  # live

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)  # the seeds' cross_entropy over one output is 0: nothing would train
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK {self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.replica.batches(self.train_data):  # live
            self.replica.step(self._run_batch, source, targets)  # live

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in self.replica.epochs(self.epochs_run, max_epochs):  # live
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    init_process_group(backend="gloo")
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                        sampler=DistributedSampler(dataset))
    start = [t.clone() for t in model.state_dict().values()]
    trainer = Trainer(model, loader, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:12]
    moved = max(float((t - s).abs().max()) for t, s in zip(model.state_dict().values(), start))
    print(f"[RANK {trainer.global_rank}] done: weights {digest} moved {moved:.6g}")
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
