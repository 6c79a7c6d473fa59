"""``ddpkit run``'s goodput lines from the watch's recorder (``watch.steplines``): contiguous windows of the steps
that ended, DDP's sampled sync scaled to them, ``Finished`` only for a script that returned 0, on rank 0."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ddpkit.goodput.records import Finished, RankStarted, Steps, rank_file, read_goodput
from ddpkit.watch.steplines import StepLines


class FakeRecorder:
    """The recorder's fields ``StepLines`` reads (the real one counts DDP forwards)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size, self.host = rank, 2, "h1"
        self.steps, self.step_at, self.first_step_at = 0, 0.0, 0.0
        self.sync_total, self.sync_samples = 0.0, 0
        self.epochs: list[tuple[int, int, float]] = []
        self.loaded_state = False

    def forward(self, at: float, sync: float | None = None) -> None:
        self.steps += 1
        self.step_at = at
        if self.steps == 1:
            self.first_step_at = at
        if sync is not None:
            self.sync_total += sync
            self.sync_samples += 1


@pytest.fixture(autouse=True)
def _fresh_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_ATTEMPT", "2")


def test_windows_cover_the_ended_steps_without_gaps(tmp_path: Path) -> None:
    rec = FakeRecorder(0)
    lines = StepLines(tmp_path, rec)  # type: ignore[arg-type]
    lines.beat()  # no step yet: nothing
    for i in range(25):  # a step every 0.1 s from t=100; DDP's sync sampled every 10th step
        rec.forward(100.0 + 0.1 * i, sync=0.02 if i % 10 == 0 else None)
        lines.beat()
    lines.end(0)
    records = read_goodput(tmp_path)
    assert isinstance(records[0], RankStarted) and records[0].attempt == 2 and records[0].world_size == 2
    steps = [r for r in records if isinstance(r, Steps)]
    assert [(s.first, s.last) for s in steps] == [(1, 10), (11, 20), (21, 24)]  # step 25 is in flight: not counted
    assert all(a.end == b.start for a, b in itertools.pairwise(steps))
    assert steps[0].start == 100.0 and steps[-1].end == pytest.approx(102.4)
    assert sum(s.busy_s for s in steps) == pytest.approx(2.4)
    assert steps[0].p50_ms == pytest.approx(100.0)
    assert steps[0].sync_s == pytest.approx(0.02 * 10)  # the samples' mean, times the window's steps
    assert steps[-1].sync_s is None  # no sample fell in it
    assert isinstance(records[-1], Finished) and records[-1].step == 24 and records[-1].outcome == "completed"


def test_a_failed_script_and_another_rank_write_no_finished_line(tmp_path: Path) -> None:
    for rank, code in ((0, 1), (1, 0)):
        rec = FakeRecorder(rank)
        lines = StepLines(tmp_path, rec)  # type: ignore[arg-type]
        for i in range(5):
            rec.forward(10.0 + i)
            lines.beat()
        lines.end(code)
        lines.beat()  # after the end: nothing, no error
    zero, one = read_goodput(tmp_path), read_goodput(tmp_path / rank_file(1))
    assert [type(r) for r in zero] == [RankStarted, Steps, Steps, Steps, Steps]
    assert [(r.first, r.last, r.rank) for r in one if isinstance(r, Steps)] == [(1, 1, 1), (2, 2, 1), (3, 3, 1),
                                                                                 (4, 4, 1)]


def test_a_script_without_steps_writes_nothing(tmp_path: Path) -> None:
    """No DDP forward seen (a script without a DDP model): no line at all, so its attempt reads as unmeasured."""
    lines = StepLines(tmp_path, FakeRecorder(0))  # type: ignore[arg-type]
    lines.beat()
    lines.end(0)
    assert read_goodput(tmp_path) == []


def test_a_beat_between_counting_step_1_and_stamping_it_waits(tmp_path: Path) -> None:
    """The watch's thread may read the step count after the main thread counted step 1 but before it stamped its
    start: no line then (a window from the epoch's 0 would be 55 years long), the next beat writes it."""
    rec = FakeRecorder(0)
    lines = StepLines(tmp_path, rec)  # type: ignore[arg-type]
    rec.steps, rec.step_at = 1, 50.0  # counted, first_step_at not yet set
    lines.beat(final=True)
    assert read_goodput(tmp_path) == []
    rec.first_step_at = 50.0
    rec.forward(51.0)
    lines.end(0)
    steps = [r for r in read_goodput(tmp_path) if isinstance(r, Steps)]
    assert [(s.start, s.end, s.first, s.last) for s in steps] == [(50.0, 51.0, 1, 1)]
