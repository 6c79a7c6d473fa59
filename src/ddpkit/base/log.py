"""Logging: libraries get loggers; only the CLI configures, once, with a ``[host:rank]`` prefix."""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["configure", "get_logger"]

_configured = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("ddpkit") else f"ddpkit.{name}")


def configure(verbose: int = 0) -> None:
    """Set up ddpkit's log handler once. Rank comes from whatever launcher variable is present."""
    global _configured
    if _configured:
        return
    _configured = True
    rank = next((os.environ[v] for v in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
                 if v in os.environ), "-")
    host = socket.gethostname().split(".", 1)[0]
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[{host}:{rank}] %(levelname)s %(message)s"))
    root = logging.getLogger("ddpkit")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO if verbose == 1 else logging.WARNING)
    root.propagate = False
