"""The built-in job's data and models, and the per-rank batches of any dataset.

The data is the seeds' shape (2048 samples of 20 features -> 1 target) but seeded and with a real signal:
``y = x @ w + b + 0.1 * noise``, identical on every rank, so an MSE loss actually goes down.

Batches follow ``torch.utils.data.DistributedSampler`` exactly (its own index order, shuffled per epoch via
``set_epoch``, padded to a multiple of the world size). For tensor datasets the batch is taken by one indexing
operation per tensor instead of the seeds' per-sample ``Dataset.__getitem__`` + ``DataLoader`` collate, which is
where most of the seeds' time went; any other dataset goes through a DataLoader with the same indices.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

__all__ = ["Batches", "make_dataset", "make_model", "model_features"]


def model_features(model: str) -> tuple[int, int]:
    """(input features, outputs) of a built-in model."""
    return {"linear": (20, 1), "toy": (10, 5), "mlp": (256, 1)}[model]


def make_dataset(model: str, samples: int, seed: int) -> TensorDataset:
    """Seeded synthetic regression data with signal; the same on every rank."""
    n_in, n_out = model_features(model)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, n_in, generator=g)
    w = torch.randn(n_in, n_out, generator=g) / n_in**0.5
    b = torch.randn(n_out, generator=g)
    y = x @ w + b + 0.1 * torch.randn(samples, n_out, generator=g)
    return TensorDataset(x, y)


def make_model(model: str, width: int = 2048, depth: int = 2) -> nn.Module:
    """linear: Linear(20,1); toy: Linear(10,10)-ReLU-Linear(10,5); mlp: 256 -> width x depth (ReLU) -> 1."""
    if model == "linear":
        return nn.Linear(20, 1)
    if model == "toy":
        return nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    layers: list[nn.Module] = []
    n_in = model_features("mlp")[0]
    for _ in range(depth):
        layers += [nn.Linear(n_in, width), nn.ReLU()]
        n_in = width
    layers.append(nn.Linear(n_in, 1))
    return nn.Sequential(*layers)


class Batches:
    """This rank's batches of ``dataset`` for an epoch, starting at any batch (a mid-epoch resume)."""

    def __init__(self, dataset: Dataset[Any], *, batch_size: int, rank: int, world_size: int, seed: int,
                 device: torch.device) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.device = device
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.tensors: tuple[torch.Tensor, ...] | None = None
        if isinstance(dataset, TensorDataset):
            self.tensors = tuple(t.pin_memory() if device.type == "cuda" else t for t in dataset.tensors)

    @property
    def samples_per_rank(self) -> int:
        return self.sampler.num_samples

    def steps(self) -> int:
        return -(-self.sampler.num_samples // self.batch_size)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        """Batches ``start..`` of ``epoch``, already on this rank's device."""
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(self.sampler)), dtype=torch.long)
        chunks = list(order.split(self.batch_size))[start:]
        if self.tensors is not None:
            for idx in chunks:
                yield tuple(t[idx].to(self.device, non_blocking=True) for t in self.tensors)
            return
        loader = DataLoader(self.dataset, batch_sampler=[c.tolist() for c in chunks],
                            pin_memory=self.device.type == "cuda")
        for batch in loader:
            yield tuple(t.to(self.device, non_blocking=True) for t in batch)
