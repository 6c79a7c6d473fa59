"""A user's own job for ``ddpkit train --make-job train_user_job:make_job`` (used by the tests)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit.train import TrainConfig, TrainJob


class Squares(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset (not a TensorDataset): items are made one by one, as in most user code."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.rand(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        return x, (x**2).sum(dim=0, keepdim=True)


def make_job(config: TrainConfig) -> TrainJob:
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    return TrainJob(model=model, dataset=Squares(config.samples),
                    optimizer=torch.optim.Adam(model.parameters(), lr=0.01), loss_fn=nn.functional.mse_loss,
                    name="squares")
