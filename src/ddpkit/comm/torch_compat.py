"""Collectives whose names changed across the torch versions ddpkit supports (torch >= 2.2).

torch 2.13 names the tensor forms ``all_gather_single`` / ``reduce_scatter_single`` and deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (a FutureWarning on every call); older torch has only those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["all_gather_single", "reduce_scatter_single"]


def all_gather_single() -> Callable[..., Any]:
    """``fn(output, input, group=None, async_op=False)``: input gathered from every rank, rank-major in output."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single() -> Callable[..., Any]:
    """``fn(output, input, op=..., group=None, async_op=False)``."""
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
