"""ddpkit train, pure parts: snapshot format and selection, drills, config validation, batches, RNG state."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ddpkit.base.errors import ConfigError
from ddpkit.comm.rng import capture_rng, restore_rng
from ddpkit.train.config import TrainConfig, parse_drill, snapshot_location
from ddpkit.train.data import Batches, make_dataset
from ddpkit.train.faults import DrillBook
from ddpkit.train.snapshot import SnapshotDir, read_snapshot, write_snapshot
from ddpkit.train.staging import AsyncWriter
from ddpkit.train.timeline import MARKS, phases


def _state(value: float) -> dict[str, object]:
    return {"model": {"w": torch.full((3, 4), value)}, "step": int(value)}


def _write(snaps: SnapshotDir, step: int) -> Path:
    path = snaps.path_for(step)
    write_snapshot(path, _state(float(step)), {"global_step": step})
    return path


def test_snapshot_round_trip_and_fallback_past_truncated_and_corrupt(tmp_path: Path) -> None:
    snaps = SnapshotDir(tmp_path, "snap", ".pt", keep=5)
    for step in (10, 20, 30):
        _write(snaps, step)
    header, state = read_snapshot(snaps.path_for(30))
    assert header["global_step"] == 30 and torch.equal(state["model"]["w"], torch.full((3, 4), 30.0))

    newest = snaps.path_for(30)
    newest.write_bytes(newest.read_bytes()[:-7])  # truncated: a writer died (or a copy stopped) mid-file
    middle = snaps.path_for(20)
    data = bytearray(middle.read_bytes())
    data[-20] ^= 0xFF  # one flipped bit in the payload
    middle.write_bytes(bytes(data))
    info, skipped = snaps.newest_valid()
    assert info is not None and info.global_step == 10
    assert len(skipped) == 2 and "truncated" in skipped[0] and "corrupt" in skipped[1]


def test_a_large_state_is_checksummed_in_one_pass_and_a_flipped_bit_in_its_tensors_is_caught(tmp_path: Path) -> None:
    """Tensors of a MiB and more take write_snapshot's direct path (their storage hashed in place on a helper thread,
    no copy); a view saves its whole storage. The header's SHA-256 and length are those of the bytes on disk."""
    import hashlib

    from ddpkit.train.snapshot import MAGIC

    big = torch.arange(1 << 20, dtype=torch.float32)
    state = {"model": {"w": big.view(1024, 1024), "half": big[::2], "b": torch.ones(7)}, "step": 3}
    path = tmp_path / "snap.000000003.pt"
    phases: dict[str, float] = {}
    written = write_snapshot(path, state, {"global_step": 3}, phases)
    data = path.read_bytes()
    end = data.index(b"\n", len(MAGIC)) + 1
    header, loaded = read_snapshot(path)
    assert written == len(data) and header["length"] == len(data) - end
    assert header["sha256"] == hashlib.sha256(data[end:]).hexdigest()
    assert torch.equal(loaded["model"]["w"], big.view(1024, 1024)) and torch.equal(loaded["model"]["half"], big[::2])
    assert set(phases) == {"serialise_write", "checksum", "header", "fsync", "rename"}
    assert torch.serialization.get_crc32_options()  # off for the snapshot's save only: the user's saves keep it
    flipped = bytearray(data)
    flipped[end + len(flipped[end:]) // 2] ^= 0x01  # inside the tensor data
    path.write_bytes(bytes(flipped))
    info, skipped = SnapshotDir(tmp_path, "snap", ".pt", keep=1).newest_valid()
    assert info is None and "corrupt" in skipped[0]


def test_prune_keeps_the_newest_and_stale_temp_files_go(tmp_path: Path) -> None:
    snaps = SnapshotDir(tmp_path, "snap", ".pt", keep=2)
    for step in (1, 2, 3, 4):
        _write(snaps, step)
    stale = tmp_path / ".snap.000000005.pt.tmp-999"
    stale.write_bytes(b"half")
    snaps.prune()
    snaps.remove_stale_temps()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.000000003.pt", "snap.000000004.pt"]


def test_async_writer_writes_the_same_bytes_and_reraises(tmp_path: Path) -> None:
    writer = AsyncWriter()
    release = threading.Event()

    def copy_when_released() -> dict[str, Any]:
        release.wait(timeout=60)
        return _state(1.0)

    writer.submit(tmp_path / "a.pt", copy_when_released, {"global_step": 1})
    assert writer.copying  # the copy has not run: the training thread must not step yet
    release.set()
    assert writer.wait_copied() >= 0 and not writer.copying
    writer.join()
    write_snapshot(tmp_path / "b.pt", _state(1.0), {"global_step": 1})
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    writer.submit(tmp_path / "missing-dir" / "c.pt", lambda: _state(1.0), {"global_step": 1})
    with pytest.raises(FileNotFoundError):
        writer.join()

    def failing_copy() -> dict[str, Any]:
        raise RuntimeError("copy failed")

    writer.submit(tmp_path / "d.pt", failing_copy, {"global_step": 1})
    writer.wait_copied()  # returns although the copy failed; the failure surfaces at join
    with pytest.raises(RuntimeError, match="copy failed"):
        writer.join()


def test_snapshot_location_file_and_directory(tmp_path: Path) -> None:
    assert snapshot_location(str(tmp_path / "run.pt")) == (tmp_path, "run", ".pt")
    assert snapshot_location(str(tmp_path)) == (tmp_path, "snapshot", ".pt")
    assert snapshot_location(str(tmp_path / "new") + "/") == (tmp_path / "new", "snapshot", ".pt")


def test_a_missing_snapshot_directory_is_made_by_rank_0_and_a_file_in_the_way_refused(tmp_path: Path) -> None:
    """``--snapshot-path snaps/`` in a new directory once exited 2 ("create it first"), as every other output path
    does not: the README's heal example did not run as written."""
    from ddpkit.train.snapshotter import Snapshotter

    config = TrainConfig(snapshot_path=f"{tmp_path}/snaps/", json_path=f"{tmp_path}/out/run.json")
    Snapshotter(config, rank=1, world_size=2, device=torch.device("cpu"))
    assert not (tmp_path / "snaps").exists()  # rank 0 alone reads and writes snapshots
    Snapshotter(config, rank=0, world_size=2, device=torch.device("cpu"))
    assert (tmp_path / "snaps").is_dir()
    (tmp_path / "file").write_text("")
    for path, words in ((f"{tmp_path}/file/snaps/", "is a file, so no directory"),
                        (f"{tmp_path}/file/", "is a file, not a directory")):
        with pytest.raises(ConfigError, match=words):
            TrainConfig(snapshot_path=path)


def test_drills_parse_and_fire_once(tmp_path: Path) -> None:
    drill = parse_drill("kill-worker@epoch=3,rank=1")
    assert (drill.kind, drill.epoch, drill.rank) == ("kill-worker", 3, 1)
    assert str(parse_drill("preempt@epoch=2")) == "preempt@epoch=2"
    for bad in ("kill@epoch=3", "preempt@epoch=2,rank=1", "kill-worker@rank=1", "preempt"):
        with pytest.raises(ConfigError):
            parse_drill(bad)
    book = DrillBook(tmp_path / "d.json", (drill,))
    assert book.due(3, 3, 8) is None and book.due(3, 4, 8) == drill
    book.record(drill, epoch=3, global_step=28, target_rank=1)
    again = DrillBook(tmp_path / "d.json", (drill,))  # the restarted attempt
    assert again.due(3, 4, 8) is None
    (report,) = again.report(resumed_step=24, interval_steps=8)
    assert report.lost_steps == 4 and report.within_interval


@pytest.mark.parametrize("kwargs", [{"save_every": 0}, {"samples": -1}, {"batch_size": 0}, {"epochs": 0},
                                    {"model": "resnet"}, {"lr": 0.0}, {"preempt_signal": "KILL"},
                                    {"batch_size": 64, "samples": 32}, {"snapshot_path": f"{__file__}/dir/s.pt"},
                                    {"job": "no_such_module_xyz:make"}, {"job": "os.path:no_such_function"},
                                    {"job": "missing_colon"}, {"drills": (parse_drill("preempt@epoch=1"),)}])
def test_bad_config_is_a_config_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TrainConfig(**kwargs)  # type: ignore[arg-type]


def test_batches_follow_distributed_sampler_and_resume_mid_epoch() -> None:
    data = make_dataset("linear", 100, seed=3)
    for rank in (0, 1):
        batches = Batches(data, batch_size=8, rank=rank, world_size=2, seed=3, device=torch.device("cpu"))
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3)
        sampler.set_epoch(5)
        expected = data.tensors[0][list(iter(sampler))]
        got = torch.cat([x for x, _ in batches.epoch(5)])
        assert torch.equal(got, expected) and batches.steps() == 7
        tail = torch.cat([x for x, _ in batches.epoch(5, start=3)])
        assert torch.equal(tail, expected[24:])


def test_rng_state_round_trip() -> None:
    saved = capture_rng()
    first = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(saved)
    second = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1]) and first[2] == second[2]


def test_phases_from_marks_and_none_where_no_step_ran() -> None:
    marks = {m: 100.0 + i for i, m in enumerate(MARKS)}
    out = phases(marks)
    assert out["startup_s"] == 4.0 and out["teardown_s"] == 1.0 and out["finished_at"] == 107.0
    assert set(out["phases_s"].values()) == {1.0}
    del marks["first_step"]  # resumed from a snapshot of a finished run: no step
    out = phases(marks)
    assert out["phases_s"]["first_step"] is None and out["phases_s"]["training"] is None
    assert "first_step_at" not in out and out["startup_s"] == 4.0


def test_a_snapshot_is_due_every_save_every_epochs_and_after_the_last() -> None:
    """One rule for the epoch loop and for a live heal that lands between an epoch's last step and its snapshot."""
    cfg = TrainConfig(epochs=7, save_every=3)
    assert [done for done in range(8) if cfg.snapshot_due(done)] == [3, 6, 7]
    assert [done for done in range(4) if TrainConfig(epochs=3).snapshot_due(done)] == [1, 2, 3]
