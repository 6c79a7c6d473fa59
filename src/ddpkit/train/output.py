"""Plain stdout lines for the trainer (torch-free, so the CLI imports it without loading torch)."""

from __future__ import annotations

import sys

__all__ = ["say"]


def say(text: str) -> None:
    """One line to stdout in a single write: ranks sharing a pipe (python -u) never split each other's lines."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
