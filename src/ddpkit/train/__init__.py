"""ddpkit's reference trainer: the seeds' DDP job done right (it trains, snapshots safely, resumes exactly,
survives killed workers and preemption). ``ddpkit train`` is the command; ``Trainer`` the Python API.

Torch loads lazily (on first use of Trainer or TrainJob), so ``ddpkit --help`` stays fast.
"""

from __future__ import annotations

from typing import Any

from ddpkit.process.stopping import RunOutcome
from ddpkit.train.config import Drill, TrainConfig
from ddpkit.train.summary import RunSummary

__all__ = ["Drill", "RunOutcome", "RunSummary", "TrainConfig", "TrainJob", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "TrainJob"):
        from ddpkit.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'ddpkit.train' has no attribute {name!r}")
