"""Snapshots that survive crashes: atomic, checksummed, self-describing, found again after a restart.

A snapshot file is ``DIR/NAME.<global step>.EXT``::

    DDPKIT-SNAPSHOT 1\\n
    {"sha256": ..., "length": N, "epoch": ..., "global_step": ..., ...}\\n     one JSON header line
    <N bytes: torch.save of the state>                                          model, optimizer, RNG, ...

It is written to a temporary file in the same directory, flushed and fsync'd, renamed over its final name
(``os.replace``, atomic on POSIX), and the directory is fsync'd so the rename itself survives a power loss.
A reader checks the magic, the length and the SHA-256 of the payload; a truncated or corrupt file is reported
and the next older one is used. Payloads load with ``weights_only=True``: only tensors and plain data.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import DiskFull
from ddpkit.log import get_logger

__all__ = ["MAGIC", "AsyncWriter", "CpuShadow", "SnapshotDir", "SnapshotInfo", "copy_to_cpu", "read_header",
           "read_snapshot",
           "write_snapshot"]

log = get_logger(__name__)
MAGIC = b"DDPKIT-SNAPSHOT 1\n"
_MAX_HEADER = 64 * 1024


class SnapshotInvalid(Exception):
    """The file is not a complete, intact ddpkit snapshot (the reason is the message)."""


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    header: dict[str, Any]

    @property
    def global_step(self) -> int:
        return int(self.header["global_step"])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(path: Path, state: Mapping[str, Any], header: Mapping[str, Any]) -> int:
    """Serialise ``state`` and write it atomically to ``path``; returns the bytes written."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    payload = buffer.getbuffer()
    head = dict(header, sha256=hashlib.sha256(payload).hexdigest(), length=len(payload))
    head_line = json.dumps(head, sort_keys=True).encode() + b"\n"
    needed = len(MAGIC) + len(head_line) + len(payload)
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        log.warning("%s has %s bytes free, this snapshot needs %s: the write will probably fail (the previous "
                    "snapshot stays intact)", path.parent, f"{free:,}", f"{needed:,}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(head_line)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # first, so that the free space reported is what the user really has
        raise _disk_full(path, needed, exc) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)
    return needed


def _disk_full(path: Path, needed: int, exc: OSError) -> DiskFull:
    """The one message a user needs: which file, how many bytes were needed and are free, and where the next run
    will resume from (the newest intact snapshot of this run, verified now)."""
    free = shutil.disk_usage(path.parent).free
    m = re.fullmatch(r"(?P<name>.+)\.\d+(?P<ext>\.[^.]*)?", path.name)
    intact = None
    if m:
        intact, _ = SnapshotDir(path.parent, m["name"], m["ext"] or "", keep=1).newest_valid()
    resume = (f"the next run resumes from {intact.path} (intact, verified, global step {intact.global_step})"
              if intact else "no intact snapshot exists yet, so the next run starts from the beginning")
    return DiskFull(f"snapshot {path} was not written: {exc.strerror} ({needed:,} bytes needed, {free:,} free "
                    f"in {path.parent}); {resume}",
                    "room for the snapshots kept (--keep) plus one being written",
                    f"free space in {path.parent}, lower --keep, or point --snapshot-path at a larger filesystem; "
                    "then run the same command again")


def read_header(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """The JSON header of a snapshot; with ``verify``, also check the payload's length and checksum."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise SnapshotInvalid("not a ddpkit snapshot (bad magic)")
        line = f.readline(_MAX_HEADER)
        try:
            header = json.loads(line)
        except ValueError:
            raise SnapshotInvalid("header is not valid JSON (truncated?)") from None
        if not verify:
            return dict(header)
        digest = hashlib.sha256()
        size = 0
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    if size != header.get("length"):
        raise SnapshotInvalid(f"payload is {size} bytes, header says {header.get('length')} (truncated)")
    if digest.hexdigest() != header.get("sha256"):
        raise SnapshotInvalid("payload checksum does not match (corrupt)")
    return dict(header)


def read_snapshot(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, state) of a verified snapshot; raises SnapshotInvalid."""
    header = read_header(path, verify=True)
    with open(path, "rb") as f:
        f.read(len(MAGIC))
        f.readline(_MAX_HEADER)
        payload = f.read()
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    return header, state


class SnapshotDir:
    """The snapshots of one run: ``DIR/NAME.<step>.EXT``, newest first, keep-K pruning, stale temp files."""

    def __init__(self, directory: Path, name: str, ext: str, keep: int) -> None:
        self.directory = directory
        self.name = name
        self.ext = ext
        self.keep = keep
        self._pattern = re.compile(rf"^{re.escape(name)}\.(\d+){re.escape(ext)}$")

    def path_for(self, global_step: int) -> Path:
        return self.directory / f"{self.name}.{global_step:09d}{self.ext}"

    def candidates(self) -> list[tuple[int, Path]]:
        """Snapshot files present, newest (highest global step) first; unverified."""
        found = []
        for entry in self.directory.iterdir():
            m = self._pattern.match(entry.name)
            if m:
                found.append((int(m[1]), entry))
        return sorted(found, reverse=True)

    def newest_valid(self) -> tuple[SnapshotInfo | None, list[str]]:
        """The newest snapshot that verifies, and one message per newer file that did not."""
        skipped: list[str] = []
        for _, path in self.candidates():
            try:
                return SnapshotInfo(path, read_header(path, verify=True)), skipped
            except (SnapshotInvalid, OSError) as exc:
                skipped.append(f"snapshot {path} is unusable: {exc}; trying the previous one")
        return None, skipped

    def prune(self) -> list[Path]:
        """Remove all but the ``keep`` newest snapshot files; returns what was removed."""
        removed = []
        for _, path in self.candidates()[self.keep:]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        return removed

    def remove_stale_temps(self) -> None:
        """Temporary files left by a writer that died mid-write (never valid snapshots)."""
        for entry in self.directory.glob(f".{self.name}.*{self.ext}.tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                log.info("removed stale temporary file %s", entry)


def copy_to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor cloned to CPU memory: a consistent image while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_to_cpu(v) for v in obj)
    return obj


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
