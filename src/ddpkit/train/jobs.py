"""Where a TrainJob comes from: the built-in model and data, or the user's ``--make-job module:function``."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ddpkit.base.errors import ConfigError
from ddpkit.train.config import TrainConfig
from ddpkit.train.data import make_dataset, make_model
from ddpkit.train.trainer import TrainJob

__all__ = ["builtin_job", "load_job"]


def builtin_job(config: TrainConfig) -> TrainJob:
    """The seeds' job, made to train: seeded data with signal, MSE, SGD."""
    torch.manual_seed(config.seed)  # the same initial model on every rank (DDP would broadcast rank 0's anyway)
    model = make_model(config.model, config.width, config.depth)
    return TrainJob(model=model, dataset=make_dataset(config.model, config.samples, config.seed),
                    optimizer=torch.optim.SGD(model.parameters(), lr=config.lr), loss_fn=nn.functional.mse_loss,
                    name=config.model)


def load_job(config: TrainConfig) -> TrainJob:
    """``config.job`` (``module:function``, called with the config) or the built-in job."""
    if config.job is None:
        return builtin_job(config)
    module_name, _, attr = config.job.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    torch.manual_seed(config.seed)
    job = factory(config)
    if not isinstance(job, TrainJob):
        raise ConfigError(f"--make-job {config.job} returned {type(job).__name__}",
                          "a ddpkit.train.TrainJob(model=..., dataset=..., optimizer=..., loss_fn=...)",
                          f"make {attr} return TrainJob(...)")
    return job
