"""Snapshots that survive crashes: atomic, checksummed, self-describing, found again after a restart.

A snapshot file is ``DIR/NAME.<global step>.EXT``::

    DDPKIT-SNAPSHOT 1\\n
    {"sha256": ..., "length": N, "epoch": ..., "global_step": ..., ...}\\n     one JSON header line
    <N bytes: torch.save of the state>                                          model, optimizer, RNG, ...

The header line is padded with spaces (JSON allows them): it is written first, with room for the length, and
filled in once the payload is written, so that the payload goes from torch.save to the file in one pass while a
helper thread checksums it. All of it goes to a temporary file in the same directory, flushed and fsync'd,
renamed over its final name (``os.replace``, atomic on POSIX), and the directory is fsync'd so the rename itself
survives a power loss.
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
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch

from ddpkit.base.errors import DiskFull
from ddpkit.base.log import get_logger

__all__ = ["MAGIC", "SnapshotDir", "SnapshotInfo", "read_header", "read_snapshot", "write_snapshot"]

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


#: Spaces reserved in the header line for the payload's length, written once the payload is (JSON allows them).
_LENGTH_ROOM = 24
#: Chunks torch.save hands over that are at least this large and lie in the state's tensor storage are hashed on
#: the helper thread without a copy; anything else (zip headers, the pickle) is copied first.
_DIRECT_BYTES = 64 << 10


class _HashingSink:
    """A file object for ``torch.save``: each chunk goes to the file and to SHA-256 in one pass over the bytes.

    The hashing runs on a helper thread (``hashlib`` releases the GIL for large buffers), in order, while this thread
    serialises and writes. torch hands each chunk as a memoryview that is valid only during ``write``: a chunk that
    lies in a tensor storage of the state (alive and unchanged until ``write_snapshot`` returns: the training thread
    waits, or works on other tensors than the shadow copy) is hashed in place; others are copied (they are small).
    """

    def __init__(self, f: Any, storages: list[tuple[int, int]]) -> None:
        self.f = f
        self.digest = hashlib.sha256()
        self.length = 0
        self.error: OSError | None = None
        self._storages = storages
        self._small = bytearray()
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-snapshot-sha256")
        self._pending: list[Future[None]] = []

    def _in_storage(self, chunk: memoryview) -> bool:
        start = int(np.frombuffer(chunk, dtype=np.uint8).ctypes.data)
        end = start + chunk.nbytes
        return any(lo <= start and end <= hi for lo, hi in self._storages)

    def _flush_small(self) -> None:
        if self._small:
            self._pending.append(self._hasher.submit(self.digest.update, bytes(self._small)))
            self._small.clear()

    def write(self, data: Any) -> int:
        chunk = memoryview(data).cast("B")
        if chunk.nbytes >= _DIRECT_BYTES and self._in_storage(chunk):
            self._flush_small()
            self._pending.append(self._hasher.submit(self.digest.update, chunk))
        else:
            self._small += chunk
            if len(self._small) >= _DIRECT_BYTES:
                self._flush_small()
        try:
            self.f.write(chunk)
        except OSError as exc:  # torch turns it into a RuntimeError about its stream; keep the cause
            self.error = exc
            raise
        self.length += chunk.nbytes
        return chunk.nbytes

    def flush(self) -> None:
        self.f.flush()

    def hexdigest(self) -> str:
        """The SHA-256 of everything written, once the helper thread has hashed it all."""
        self._flush_small()
        for pending in self._pending:
            pending.result()
        self._pending.clear()
        return self.digest.hexdigest()

    def close(self) -> None:
        self._hasher.shutdown(wait=True)


def _storages(obj: Any, out: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [start, end) address range of every CPU tensor storage in ``obj`` (tensors in dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            storage = obj.untyped_storage()
            out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _storages(v, out)
    return out


def _header_line(header: Mapping[str, Any], sha256: str, length: int, width: int = 0) -> bytes:
    line = json.dumps(dict(header, sha256=sha256, length=length), sort_keys=True).encode()
    return line.ljust(width - 1) + b"\n"


def write_snapshot(path: Path, state: Mapping[str, Any], header: Mapping[str, Any],
                   phases: dict[str, float] | None = None) -> int:
    """Serialise ``state`` and write it atomically to ``path``; returns the bytes written.

    One pass over the bytes: torch.save writes straight into the file (without the zip's own CRC32 of each record,
    which the SHA-256 makes redundant) while a helper thread checksums the same chunks; the header line (written
    first, with room for the length) gets the checksum and length at the end.
    ``phases``, when given, receives the seconds of each phase: serialise_write (serialising, writing and most
    of the checksum, overlapped), fsync (of the payload; the checksum goes on meanwhile), checksum (what was left of
    it), header (written and fdatasync'd), rename (with the directory's fsync).
    """
    t = time.perf_counter()
    storages = _storages(dict(state), [])
    head = _header_line(header, "0" * 64, 0)
    width = len(head) + _LENGTH_ROOM
    needed = len(MAGIC) + width + sum(hi - lo for lo, hi in storages)  # a lower bound: the pickle comes on top
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        log.warning("%s has %s bytes free, this snapshot needs at least %s: the write will probably fail (the "
                    "previous snapshot stays intact)", path.parent, f"{free:,}", f"{needed:,}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    spent: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        spent[name] = now - t
        t = now

    sink: _HashingSink | None = None
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + b" " * (width - 1) + b"\n")
            sink = _HashingSink(f, storages)
            # The zip's CRC32 of each record would be another pass over every byte, and the payload's SHA-256 already
            # covers them: off for this save (torch.load does not need it; `unzip -t` would then complain)
            crc32 = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
            try:
                torch.save(dict(state), cast(IO[bytes], sink))  # torch needs only write (and flush)
            except RuntimeError:
                if sink.error is not None:
                    raise sink.error from None
                raise
            finally:
                torch.serialization.set_crc32_options(crc32)
            f.flush()
            lap("serialise_write")
            os.fsync(f.fileno())  # the payload goes to disk while the helper thread finishes the checksum
            lap("fsync")
            digest = sink.hexdigest()
            lap("checksum")
            f.seek(len(MAGIC))
            f.write(_header_line(header, digest, sink.length, width))
            f.flush()
            os.fdatasync(f.fileno())  # the header's page (the file's size and blocks are already durable)
            lap("header")
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # first, so that the free space reported is what the user really has
        raise _disk_full(path, needed, exc) from None
    finally:
        if sink is not None:
            sink.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(path.parent)
    lap("rename")
    if phases is not None:
        phases.update(spent)
    return len(MAGIC) + width + sink.length


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
    return DiskFull(f"snapshot {path} was not written: {exc.strerror} (at least {needed:,} bytes needed, {free:,} free "
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
