"""ddpkit: prove a cluster runs PyTorch DistributedDataParallel.

    import ddpkit
    rt = ddpkit.init()       # rank, world size, device: from torchrun, Slurm, MPI, Kubeflow or nothing at all
    ...
    ddpkit.shutdown()

    rt = ddpkit.init(watch=True)   # a hung or slow rank named live (docs/watch.md); or: with ddpkit.watch(): ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Runtime", "WorldInfo", "__version__", "detect", "init", "shutdown", "watch"]

if TYPE_CHECKING:
    from ddpkit.env import WorldInfo, detect
    from ddpkit.runtime import Runtime, init, shutdown


def __getattr__(name: str) -> Any:
    # Lazy, so `import ddpkit` (and `ddpkit env`) does not import torch.
    if name in ("init", "shutdown", "Runtime"):
        from ddpkit import runtime

        return getattr(runtime, name)
    if name == "watch":
        import importlib

        return importlib.import_module("ddpkit.watch")
    if name in ("detect", "WorldInfo"):
        from ddpkit import env

        return getattr(env, name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")
