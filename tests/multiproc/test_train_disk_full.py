"""A full disk during a snapshot (issue 15): a real 30 MB tmpfs, ``--model mlp`` (19 MB snapshots), two ranks.

The first snapshot fits, the second does not: one message naming the file, the bytes needed and free, and the
intact snapshot the next run resumes from; exit code 74 (README); no temporary file and no traceback left.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.base.errors import EXIT_IO
from tests.helpers import require_root, run_ddpkit

pytestmark = pytest.mark.multiproc


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    require_root("mounting a 30 MB tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow  # a minute or more
def test_a_full_disk_during_a_snapshot_is_one_message_and_exit_74(small_disk: Path) -> None:
    res = run_ddpkit("train", "-n", "2", "--model", "mlp", "--epochs", "3", "--samples", "128",
                     "--snapshot-path", f"{small_disk}/", timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == EXIT_IO, out
    first = small_disk / "snapshot.000000002.pt"
    assert [p.name for p in small_disk.iterdir()] == [first.name], "only the intact snapshot, no temporary file"
    assert "Traceback" not in out and "OSError" not in out
    assert out.count("ddpkit: error: ") == 1
    message = out[out.index("ddpkit: error: "):]
    assert f"snapshot {small_disk}/snapshot.000000004.pt was not written: No space left on device" in message
    assert "bytes needed" in message and "free in" in message
    assert f"the next run resumes from {first} (intact, verified, global step 2)" in message
    assert "has" in out and "bytes free, this snapshot needs" in out  # the warning before the write

    again = run_ddpkit("train", "-n", "1", "--model", "mlp", "--epochs", "1", "--samples", "128",
                       "--snapshot-path", f"{small_disk}/", timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already complete" in again.stdout + again.stderr or "resum" in again.stdout + again.stderr
