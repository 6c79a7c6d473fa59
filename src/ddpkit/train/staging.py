"""Snapshots written in the background: a reusable CPU shadow of the state, and the thread that copies and writes.

The training thread hands over the live tensors; the writer thread copies them into the shadow (the only part the
training thread waits for, before its next optimizer step) and then writes the copy (train/snapshot.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit.train.snapshot import write_snapshot

__all__ = ["AsyncWriter", "CpuShadow"]


class CpuShadow:
    """Reusable CPU buffers for snapshot copies: after the first snapshot, a copy is a memcpy, not an allocation
    (fresh pages cost more than the copy itself). A buffer is reused only after the writer has joined."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, obj: Any, key: str = "") -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self._buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self._buffers[key] = torch.empty_like(obj, device="cpu")
            return buf.copy_(obj.detach())
        if isinstance(obj, dict):
            return {k: self.copy(v, f"{key}/{k}") for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            items = [self.copy(v, f"{key}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj


class AsyncWriter:
    """Copies and writes snapshots on one background thread.

    ``submit(make_state, ...)`` returns at once; the thread first calls ``make_state()`` (the in-memory copy of
    the live tensors), then serialises, checksums, writes, fsyncs and renames. The caller must not change
    those tensors in place until ``wait_copied()`` returns; ``join()`` waits for the whole write and re-raises
    the writer's failure.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()
        self._copied.set()
        self.last_write_s = 0.0

    @property
    def copying(self) -> bool:
        """True while the in-memory copy of the last submitted state is still running."""
        return not self._copied.is_set()

    def submit(self, path: Path, make_state: Callable[[], Mapping[str, Any]], header: Mapping[str, Any],
               after: Callable[[], None] | None = None) -> None:
        self.join()
        self._copied.clear()

        def work() -> None:
            try:
                t0 = time.perf_counter()
                try:
                    state = make_state()
                finally:
                    self._copied.set()  # on failure too: the training thread must never wait forever
                write_snapshot(path, state, header)
                self.last_write_s = time.perf_counter() - t0
                if after is not None:
                    after()
            except BaseException as exc:  # surfaced on the training thread at the next join
                self._error = exc

        self._thread = threading.Thread(target=work, name="ddpkit-snapshot-writer", daemon=False)
        self._thread.start()

    def wait_copied(self) -> float:
        """Block until the submitted state is copied (the live tensors may change again); returns seconds waited."""
        t0 = time.perf_counter()
        self._copied.wait()
        return time.perf_counter() - t0

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
